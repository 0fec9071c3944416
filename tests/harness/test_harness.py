"""The harness itself: failures carry the failing rank's traceback, hangs are caught in time."""

import os
import time

import pytest
import torch.distributed as dist

from tests.harness import WorldError, WorldTimeout, get_world, multirank
from tests.harness.world import World


@multirank(world_size=2)
def test_every_rank_runs_the_body():
    assert dist.get_world_size() == 2
    ranks = [None, None]
    dist.all_gather_object(ranks, dist.get_rank())
    assert ranks == [0, 1]


@multirank(world_size=2, timeout=60)
def _rank1_raises():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")


def test_a_failing_rank_reports_its_traceback():
    with pytest.raises(WorldError) as info:
        _rank1_raises()
    text = str(info.value)
    assert "failed on ranks [1]" in text
    assert "ValueError: boom on rank one" in text
    assert "_rank1_raises" in text  # the traceback points into the body


@multirank(world_size=2, timeout=8)
def _rank0_waits_for_a_barrier_rank1_never_joins():
    if dist.get_rank() == 0:
        dist.barrier()
    else:
        time.sleep(3600)


def test_a_hang_is_caught_within_the_timeout_and_the_world_is_replaced():
    old_pids = [p.pid for p in get_world(2).procs]
    start = time.monotonic()
    with pytest.raises(WorldTimeout) as info:
        _rank0_waits_for_a_barrier_rank1_never_joins()
    elapsed = time.monotonic() - start
    assert elapsed < 8 + 15, f"hang detection took {elapsed:.1f} s"
    text = str(info.value)
    assert "ranks [0, 1] did not finish within 8 s" in text
    # Each stuck rank's Python stack is shown, pointing at where it waits.
    stack0 = text.split("--- rank 0 stack ---")[1].split("--- rank 1 stack ---")[0]
    stack1 = text.split("--- rank 1 stack ---")[1]
    assert " in barrier" in stack0 and "_rank0_waits_for_a_barrier" in stack0
    assert " in barrier" not in stack1 and "_rank0_waits_for_a_barrier" in stack1
    assert all(not _alive(pid) for pid in old_pids)
    # The next test gets a fresh, working world.
    test_every_rank_runs_the_body()
    assert [p.pid for p in get_world(2).procs] != old_pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_a_slow_world_start_is_retried_once_with_a_fresh_port_and_a_longer_timeout(capsys):
    world = World(1, "gloo", start_timeout_s=0.01, retry_timeout_s=300)
    world.start()  # no rank imports torch in 0.01 s: the first attempt times out
    try:
        assert world.alive() and len(world.procs) == 1
        world.run("tests.harness.test_harness:_rank1_raises", {}, timeout=60)  # a working world
    finally:
        world.close()
    err = capsys.readouterr().err
    assert "world of 1 ranks failed to start (world of 1 ranks did not start within 0 s" in err
    assert "retrying once with a fresh port and a 300 s timeout" in err


def test_a_second_failed_start_is_raised():
    with pytest.raises(WorldTimeout, match="did not start within 0 s"):
        World(1, "gloo", start_timeout_s=0.01, retry_timeout_s=0.01).start()
