"""A LoRA-wrapped MoE layer (router LoRA + per-expert fc1/fc2 adapters, non-zero factors, aux
loss on) equals a single-process reference built from the same global weights: output, aux loss,
input gradient, router-LoRA gradients and every expert adapter's gradients (each rank checks the
shards it holds of every global expert), fp32, atol 1e-5, at EP {1, 2, 4} x expert-TP {1, 2} x
TP {1, 2} (SP when TP > 1) x dispatcher {allgather, alltoall}, through megatron DDP and
finalize_model_grads. World size = max(TP, EP * ETP), so data parallelism (dense and expert) is
exercised wherever the two differ. One body per world size (worlds are expensive to start)."""

import pytest

from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank

LAYOUTS = [
    ParallelLayout(tp=tp, ep=ep, etp=etp, sp=tp > 1)
    for tp in (1, 2) for ep in (1, 2, 4) for etp in (1, 2)
]


def world_of(layout) -> int:
    return max(layout.tp, layout.ep * layout.expert_tp)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8], ids=lambda w: f"world{w}")
@multirank(world_size=lambda world_size, **_: world_size, timeout=900)
def test_moe_layer_matches_reference_at_every_layout(world_size):
    from megatron_lora import runtime
    from tests.lora._moe_support import run_moe_case

    report = {}
    cases = 0
    for layout in (lay for lay in LAYOUTS if world_of(lay) == world_size):
        # One initialisation per layout (the dispatcher is a config choice): every re-initialised
        # world leaves gloo threads behind, so fewer of them keep the reused worlds light.
        runtime.initialize(layout, seed=1234)
        for dispatcher in ("allgather", "alltoall"):
            cases += 1
            bad = run_moe_case(layout, dispatcher)
            if bad:
                report[f"TP{layout.tp}xEP{layout.ep}xETP{layout.expert_tp}/{dispatcher}"] = bad
    assert cases > 0
    assert not report, f"{len(report)}/{cases} layouts differ from the reference: {report}"
