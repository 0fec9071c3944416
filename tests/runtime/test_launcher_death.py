"""`kill -9` of torchrun: its ranks (started in sessions of their own) stop at once and write
nothing more, instead of training and saving on as orphans."""

import os
import signal
import socket
import subprocess
import sys
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Each rank writes a file every 50 ms on its own (no collective that would block an orphan).
_WRITER = """
import os, sys, time
from megatron_lora import runtime
runtime.init_process_group(backend="gloo")
out, rank, i = sys.argv[1], os.environ["RANK"], 0
while True:
    open(os.path.join(out, f"rank{rank}_{i:06d}"), "w").close()
    i += 1
    time.sleep(0.05)
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(_free_port()), *args]


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def _kill_launcher_and_check(proc, ready, listing, timeout=240):
    """Wait for ready(), SIGKILL only the torchrun process, then assert that its ranks are gone
    within a few seconds and that listing() no longer changes. Always cleans up."""
    ranks = []
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert proc.poll() is None, "torchrun ended early"
            assert time.monotonic() < deadline, "the ranks did not start writing in time"
            time.sleep(0.05)
        ranks = psutil.Process(proc.pid).children()
        assert len(ranks) == 2, ranks
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        at_kill = listing()
        start = time.monotonic()
        _, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive, f"ranks still running 10 s after the launcher died: {alive}"
        assert time.monotonic() - start < 5
        time.sleep(1.0)
        assert listing() == at_kill  # nothing written after the kill
    finally:
        if proc.poll() is None:
            try:
                ranks = ranks or psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
            proc.kill()
        proc.wait(timeout=30)
        for p in ranks:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(ranks, timeout=10)


def test_ranks_stop_when_torchrun_is_killed(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    proc = subprocess.Popen(_torchrun(str(script), str(out)), cwd=ROOT, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)

    def ready():
        names = os.listdir(out)
        return any(n.startswith("rank0_") for n in names) and any(
            n.startswith("rank1_") for n in names)

    _kill_launcher_and_check(proc, ready, lambda: sorted(os.listdir(out)))
