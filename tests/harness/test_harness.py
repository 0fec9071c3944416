"""The harness itself: failures carry the failing rank's traceback, hangs are caught in time."""

import os
import time

import pytest
import torch.distributed as dist

from tests.harness import WorldError, WorldTimeout, get_world, multirank


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
