"""A LoRA-wrapped MoE layer (router LoRA + per-expert fc1/fc2 adapters, non-zero factors, aux
loss on) equals a single-process reference built from the same global weights: output, aux loss,
input gradient, router-LoRA gradients and every expert adapter's gradients (each rank checks the
shards it holds of every global expert), fp32, each within the bound of _moe_support.py's
docstring (compare.gradient_bound over chains of _moe_support.chain(dp) terms), at EP {1, 2, 4}
x expert-TP {1, 2} x TP {1, 2} (SP when TP > 1) x dispatcher {allgather, alltoall}, through
megatron DDP and finalize_model_grads. World size = max(TP, EP * ETP), so data parallelism
(dense and expert) is exercised wherever the two differ. One body per world size (worlds are
expensive to start).

A representative subset (EP 1 / EP 2 / expert-TP 2, TP 2 with SP, both dispatchers) runs again
with dropout 0.25 and rsLoRA on the router and every expert adapter: the reference builds every
mask from the global definition (token position in the replica, global feature) under the replayed
keys, so passing at each of them means the expert masks are the same at every layout and
dispatcher."""

import pytest

from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank

LAYOUTS = [
    ParallelLayout(tp=tp, ep=ep, etp=etp, sp=tp > 1)
    for tp in (1, 2) for ep in (1, 2, 4) for etp in (1, 2)
]


# (tp, ep, etp) that also run with dropout + rsLoRA (one or two per world; world 8 stays as is).
DROPOUT_LAYOUTS = {(1, 1, 1), (1, 2, 1), (2, 1, 2), (2, 2, 2)}


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
        variants = [(0.0, False)]
        if (layout.tp, layout.ep, layout.expert_tp) in DROPOUT_LAYOUTS:
            variants.append((0.25, True))
        for dispatcher in ("allgather", "alltoall"):
            for dropout, rslora in variants:
                cases += 1
                bad = run_moe_case(layout, dispatcher, dropout=dropout, rslora=rslora)
                if bad:
                    name = f"TP{layout.tp}xEP{layout.ep}xETP{layout.expert_tp}/{dispatcher}"
                    report[name + ("/p0.25+rslora" if dropout else "")] = bad
    assert cases > 0
    assert not report, f"{len(report)}/{cases} layouts differ from the reference: {report}"


def test_routing_margin_check_sees_a_tie_and_passes_the_test_data():
    """The parity runs first check that top-k routing cannot depend on summation order
    (_moe_support.check_routing_margin); the check fires on tied logits (a zero router) and
    passes on the global batch every layout uses (8 replicas: the largest data-parallel size)."""
    import torch

    from megatron_lora.lora import AdapterConfig
    from megatron_lora.lora.adapter import init_global_factors
    from tests.lora import _moe_support as M

    weights = M.global_weights()
    config = AdapterConfig(rank=M.RANK, alpha=M.ALPHA, init_lora_weights=False)
    factors = init_global_factors(config, M.H, M.E, M.seed_for("router"))
    x_all, _ = M.global_batch(8)
    scale = M.ALPHA / M.RANK
    for r in range(8):
        errors = {}
        M.check_routing_margin(errors, weights, factors, x_all[r], scale)
        assert not errors, errors
    tied = dict(weights, router=torch.zeros_like(weights["router"]))
    errors = {}
    M.check_routing_margin(errors, tied, [torch.zeros_like(f) for f in factors], x_all[0], scale)
    assert "routing depends on summation order" in errors["routing_margin"], errors
