"""Every gloo process group of a rank shares one transport device (runtime/gloo_device.py): one
event-loop thread per process instead of one per group, and the groups work as before."""

import os

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_lora.runtime import ParallelLayout, gloo_device
from megatron_lora.runtime.distributed import _live_groups
from tests.harness import multirank

GROUPS = 8
pytestmark = pytest.mark.skipif(torch.cuda.device_count() >= 2,
                                reason="the test worlds use NCCL here: no gloo groups to share")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _devices(group):
    return group._get_backend(torch.device("cpu")).options._devices


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc to count threads")
@multirank(world_size=2)
def test_new_groups_add_no_event_loop_thread():
    assert gloo_device.installed()
    before = _threads()
    groups = [dist.new_group([0, 1]) for _ in range(GROUPS)]
    added = _threads() - before
    # Each gloo group starts its 2 worker threads; an own device would add its loop thread too.
    assert added <= 2 * GROUPS + 1, f"{GROUPS} groups added {added} threads"
    world_device = _devices(dist.group.WORLD)[0]
    assert all(_devices(g) == [world_device] for g in groups)
    for i, g in enumerate(groups):  # and each group still reduces on its own
        x = torch.full((3,), float(dist.get_rank() + i))
        dist.all_reduce(x, group=g)
        assert x.tolist() == [2.0 * i + 1] * 3
    for g in groups:
        dist.destroy_process_group(g)


@multirank(world_size=2)
def test_megatron_groups_share_the_device(layout=ParallelLayout(tp=2, sp=True)):
    world_device = _devices(dist.group.WORLD)[0]
    groups = [g for g in _live_groups() if g is not dist.group.WORLD]
    assert len(groups) >= 10, len(groups)  # megatron's groups for this layout
    assert all(_devices(g) == [world_device] for g in groups)
    x = torch.ones(2)
    dist.all_reduce(x, group=parallel_state.get_tensor_model_parallel_group())
    assert x.tolist() == [2.0, 2.0]
