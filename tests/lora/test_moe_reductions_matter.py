"""Expert-adapter gradients need the right reductions: the expert-data-parallel group (not the
dense one) and the expert-TP sum of replicated factors. With data parallelism next to EP they equal
the reference over the whole global batch; registered as dense parameters (allreduce=True, the
bug Megatron-Bridge shipped) or without the expert-TP sum, the same comparison fails."""

import pytest

from megatron_lora.lora import collectives as C
from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank


def _keep_partial(ctx, grad):  # the expert-TP sum of a replicated factor's gradient, switched off
    return grad, None


@pytest.mark.parametrize("world_size", [2, 4], ids=lambda w: f"world{w}")
@multirank(world_size=lambda world_size, **_: world_size, timeout=900)
def test_expert_adapter_gradients_need_expert_dp_and_expert_tp_reductions(world_size):
    from megatron_lora import runtime
    from tests.lora._moe_support import run_moe_case
    from tests.lora._support import patched

    # Layouts whose expert-DP group differs from the dense DP group. EP next to DP: dense
    # reduction mixes different experts' gradients; expert-TP 1 under TP 2: the expert-DP group
    # spans the TP pair (each routes its own sequence shard), the dense one does not.
    layouts = {
        2: [ParallelLayout(ep=2), ParallelLayout(tp=2, etp=1, sp=True)],  # DP 2/1, expert DP 1/2
        4: [ParallelLayout(ep=2), ParallelLayout(tp=2, etp=1, sp=True)],  # DP 4/2, expert DP 2/4
    }[world_size]
    problems = []
    for layout in layouts:
        name = f"TP{layout.tp}xEP{layout.ep}xETP{layout.expert_tp}@{world_size}"
        runtime.initialize(layout, seed=1234)
        intact = run_moe_case(layout, "alltoall")
        if intact:
            problems.append(f"{name}: the intact path fails {intact}")
        dense = run_moe_case(layout, "alltoall", dense_expert_adapters=True)
        if not any(".experts." in k for k in dense):
            problems.append(f"{name}: expert adapters registered as dense params still pass")

    # Expert-TP 2: without the in-autograd sum, replicated factors keep partial gradients.
    layout = ParallelLayout(ep=1, etp=2) if world_size == 2 else ParallelLayout(ep=2, etp=2)
    runtime.initialize(layout, seed=1234)
    with patched(C._GradSum, "backward", _keep_partial):
        broken = run_moe_case(layout, "allgather")
    replicated = [k for k in broken if k.endswith("linear_fc1.lora_A")
                  or k.endswith("linear_fc2.lora_B")]
    if not replicated:
        problems.append(f"ETP2@{world_size}: disabling the expert-TP sum went unnoticed: {broken}")
    assert not problems, "\n".join(problems)
