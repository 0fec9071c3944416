"""initialize/destroy on a live world: bad layouts fail on every rank without a hang, layouts can
follow each other in the same processes, and RNG streams are reproducible per layout."""

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_lora import runtime
from megatron_lora.models.gpt import tiny_moe_shape
from megatron_lora.runtime import LayoutError, ParallelLayout
from tests.harness import multirank

SIZES = tiny_moe_shape().layout_sizes()


@multirank(world_size=4)
def test_bad_layouts_raise_on_every_rank_before_any_collective():
    cases = [
        (ParallelLayout(tp=3, sp=True), "not a multiple of tp*pp"),
        (ParallelLayout(tp=4, sp=True), "tp=4 does not divide num_query_groups=2"),
        (ParallelLayout(ep=4, pp=2), "not a multiple of ep*etp*pp"),
        (ParallelLayout(pp=3), "pp=3 does not divide num_layers=4"),
        (ParallelLayout(ep=4, tp=2), "MoE with tp > 1 needs sequence parallelism"),
    ]
    for layout, expected in cases:
        with pytest.raises(LayoutError) as info:
            runtime.initialize(layout, model_sizes=SIZES)
        assert expected in str(info.value), str(info.value)
        assert not parallel_state.model_parallel_is_initialized()
    # Every rank got here: a collective right after the errors completes (no rank is stuck).
    flags = torch.ones(1)
    dist.all_reduce(flags)
    assert flags.item() == 4


@multirank(world_size=4)
def test_layouts_follow_each_other_in_the_same_processes():
    for layout, tp, pp, ep, dp in [
        (ParallelLayout(tp=2, sp=True), 2, 1, 1, 2),
        (ParallelLayout(pp=2, ep=2), 1, 2, 2, 2),
        (ParallelLayout(tp=2, pp=2, sp=True), 2, 2, 1, 1),
        (ParallelLayout(ep=4), 1, 1, 4, 4),
    ]:
        runtime.initialize(layout, model_sizes=SIZES)
        assert runtime.current_layout() == layout
        assert parallel_state.get_tensor_model_parallel_world_size() == tp
        assert parallel_state.get_pipeline_model_parallel_world_size() == pp
        assert parallel_state.get_expert_model_parallel_world_size() == ep
        assert parallel_state.get_data_parallel_world_size() == dp
        runtime.destroy()
        assert not parallel_state.model_parallel_is_initialized()


def _draws():
    tracker = tensor_parallel.get_cuda_rng_tracker()
    default = torch.rand(4)
    with tracker.fork():  # tensor-parallel stream: differs across TP ranks
        tp_draw = torch.rand(4)
    with tracker.fork(tensor_parallel.get_expert_parallel_rng_tracker_name()):
        ep_draw = torch.rand(4)
    return default, tp_draw, ep_draw


@multirank(world_size=2)
def test_rng_streams_are_reproducible_per_layout_and_follow_megatrons_rules():
    runtime.initialize(ParallelLayout(tp=2, sp=True), seed=7)
    first = _draws()
    runtime.initialize(ParallelLayout(tp=2, sp=True), seed=7)
    second = _draws()
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Default stream: same on every rank; tensor-parallel stream: different per TP rank.
    gathered = [torch.empty(3, 4) for _ in range(2)]
    dist.all_gather(gathered, torch.stack(first))
    torch.testing.assert_close(gathered[0][0], gathered[1][0], rtol=0, atol=0)
    assert not torch.equal(gathered[0][1], gathered[1][1])
    # Forking must not disturb the default stream.
    runtime.initialize(ParallelLayout(tp=2, sp=True), seed=7)
    torch.testing.assert_close(torch.rand(4), first[0], rtol=0, atol=0)
    # Another seed gives other numbers.
    runtime.initialize(ParallelLayout(tp=2, sp=True), seed=8)
    assert not torch.equal(_draws()[1], first[1])


@multirank(world_size=2)
def test_destroy_frees_megatrons_process_groups_and_their_threads():
    import os

    from torch.distributed import distributed_c10d

    def native_threads():
        return len(os.listdir("/proc/self/task"))

    runtime.initialize(ParallelLayout(tp=2, sp=True))
    runtime.destroy()
    groups, threads = len(distributed_c10d._world.pg_map), native_threads()
    for _ in range(5):
        runtime.initialize(ParallelLayout(ep=2))
        assert len(distributed_c10d._world.pg_map) > groups
        runtime.destroy()
    assert len(distributed_c10d._world.pg_map) == groups
    assert native_threads() <= threads + 2  # gloo threads of the groups are gone
    flags = torch.ones(1)
    dist.all_reduce(flags)  # the world group still works
    assert flags.item() == 2


@multirank(world_size=1)
def test_destroy_resets_megatrons_moe_globals(layout=ParallelLayout()):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    # A 0-d scale set by one test used to break the next one's [1]-shaped scale (copy_ into []).
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    runtime.destroy()
    assert MoEAuxLossAutoScaler.main_loss_backward_scale is None
    runtime.initialize(ParallelLayout())
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))
    assert MoEAuxLossAutoScaler.main_loss_backward_scale.shape == (1,)
