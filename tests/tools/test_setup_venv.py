"""tools/setup_venv.sh says what it is doing, one line per step, and nothing else of its own.

Run against a stand-in Python (a script that records its arguments and does nothing), so that no
package is installed: the lines it prints and the commands it runs are the script's own.
"""

import os
import stat
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FAKE = """#!/usr/bin/env bash
echo "$*" >> "{log}"
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; fi
if [ "$1" = "-V" ]; then echo "Python 3.11.7"; fi
if [ "$1" = "-c" ] && [[ "$2" == *"print("* ]]; then echo "setup (x): ready, megatron-core 0.16.1"; fi
exit 0
"""


def test_each_step_prints_one_line(tmp_path):
    log = tmp_path / "calls.log"
    fake = tmp_path / "python3"
    fake.write_text(FAKE.format(log=log))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    venv = tmp_path / "venv"
    done = subprocess.run(["bash", os.path.join(ROOT, "tools", "setup_venv.sh"), str(venv)],
                          env=dict(os.environ, PYTHON=str(fake)), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    steps = [line.split(": ", 1)[1] for line in lines[:-1]]
    assert [s.split(" ")[0] for s in steps] == ["creating", "installing", "installing",
                                                "checking"], lines
    assert steps[0] == "creating the virtual environment with Python 3.11.7", lines
    assert steps[1] == "installing torch==2.13.0 (CPU build)", lines
    assert lines[-1].endswith("ready, megatron-core 0.16.1"), lines
    assert all(line.startswith(f"setup ({venv}): ") for line in lines[:-1]), lines
    assert done.stderr == "", done.stderr
    calls = log.read_text().splitlines()
    # every pip install is announced: as many install lines as pip installs
    assert sum(" pip install" in f" {c}" for c in calls) == 2, calls
    assert (venv / ".installed").exists()
