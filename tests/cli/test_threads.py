"""With OMP_NUM_THREADS unset, a computing command gives torch the cores this process may run on
divided among the node's ranks (at least 1), and says so once (rank 0); OMP_NUM_THREADS, when
set, decides. (A one-rank CPU train with torch's own count ran 17-29 s per iteration on a busy
machine, 0.5-0.7 s with one thread per core and rank.) Each case runs in its own process, whose
thread count is what it checks."""

import os
import subprocess
import sys

import pytest

PROBE = """
import os, torch
os.sched_setaffinity(0, {{0}})          # one core to run on
torch.set_num_threads(4)                # as if torch had counted more
from megatron_lora.cli.common import default_threads
default_threads()
print("threads", torch.get_num_threads())
"""


@pytest.mark.parametrize("omp,rank,threads,said", [
    (None, "0", 1, True), (None, "1", 1, False), ("3", "0", 4, False)])
def test_threads_per_rank(omp, rank, threads, said):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(RANK=rank, LOCAL_WORLD_SIZE="1")
    if omp:
        env["OMP_NUM_THREADS"] = omp  # set: torch's count is left alone (4 here)
    done = subprocess.run([sys.executable, "-c", PROBE.format()], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"threads {threads}" in done.stdout, (done.stdout, done.stderr)
    note = "note: OMP_NUM_THREADS is unset: torch uses 1 CPU thread(s) per rank (1 cores for 1 ranks"
    assert (note in done.stderr) == said and done.stderr.count("note: ") <= 1, \
        done.stderr


def test_ranks_share_the_cores():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(RANK="0", LOCAL_WORLD_SIZE="2")
    probe = PROBE.replace("{{0}}", "{{0, 1}}") if len(os.sched_getaffinity(0)) >= 2 else None
    if probe is None:
        pytest.skip("needs 2 cores")
    done = subprocess.run([sys.executable, "-c", probe.format()], env=env, capture_output=True,
                          text=True, timeout=120)
    assert "threads 1" in done.stdout and "(2 cores for 2 ranks" in done.stderr, done.stderr

