"""GroupedExperts (models/grouped_experts.py): all local experts in one grouped matmul per weight
and LoRA factor, exact wherever SequentialMLP is.

- Layout parity: the LoRA-wrapped MoE layer built with GroupedExperts equals the plain-torch
  single-process reference of tests/lora/_moe_support.py (built from the global weights and the
  adapter config, never from the module under test): output, aux loss, input gradient, router and
  every expert adapter gradient, fp32 atol 1e-5, non-zero factors, at EP / expert-TP / TP+SP,
  both dispatchers, through megatron DDP (expert-data-parallel gradients), with dropout 0.25 and
  rsLoRA on a subset.
- The grouped path really runs: no per-expert MLP forward is called, the weights share one
  buffer (also after `.to()`), and the grouped matmul is the one doing the work.
- Mixed adapters (a rank pattern giving experts different ranks) and merged adapters take the
  per-adapter fallback and still equal SequentialMLP with the same weights.
"""

import pytest

from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank

# (layout, dispatchers, with dropout + rsLoRA) per world size
CASES = {
    1: [(ParallelLayout(), ("allgather",), True)],
    2: [(ParallelLayout(ep=2), ("allgather", "alltoall"), True),
        (ParallelLayout(etp=2), ("alltoall",), True),
        (ParallelLayout(tp=2, sp=True), ("allgather",), False)],
    4: [(ParallelLayout(tp=2, ep=2, sp=True), ("allgather", "alltoall"), True),
        (ParallelLayout(ep=2, etp=2), ("alltoall",), True),
        (ParallelLayout(ep=4), ("alltoall",), False)],
}


@pytest.mark.parametrize("world_size", sorted(CASES), ids=lambda w: f"world{w}")
@multirank(world_size=lambda world_size, **_: world_size, timeout=600)
def test_grouped_moe_layer_matches_reference(world_size):
    from megatron_lora import runtime
    from tests.lora._moe_support import run_moe_case

    report, cases = {}, 0
    for layout, dispatchers, with_dropout in CASES[world_size]:
        runtime.initialize(layout, seed=1234)
        variants = [(0.0, False)] + ([(0.25, True)] if with_dropout else [])
        for dispatcher in dispatchers:
            for dropout, rslora in variants:
                cases += 1
                bad = run_moe_case(layout, dispatcher, dropout=dropout, rslora=rslora,
                                   grouped=True)
                if bad:
                    report[f"{layout.describe()}/{dispatcher}/p{dropout}"] = bad
    assert cases > 0
    assert not report, f"{len(report)}/{cases} grouped layouts differ from the reference: {report}"


def _layers(layout, cfg, grouped_first=True):
    """(sequential layer, grouped layer) with the same global weights and adapters."""
    from tests.lora._moe_support import build_layer, global_weights

    weights = global_weights()
    built = {}
    for grouped in ((True, False) if grouped_first else (False, True)):
        _, layer, adapters, _ = build_layer(layout, "allgather", weights, cfg, grouped=grouped)
        built[grouped] = (layer, adapters)
    return built[False], built[True]


def _run(layer, x):
    import torch

    x = x.clone().requires_grad_(True)
    layer.train()
    torch.manual_seed(3)
    out, _ = layer(x)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad


@multirank(world_size=1, timeout=300)
def test_grouped_path_runs_and_ties_weights(layout=ParallelLayout()):
    import torch

    from megatron_lora.lora import AdapterConfig
    from megatron_lora.models import grouped_experts as G
    from tests.lora._moe_support import BATCH, H, SEQ

    cfg = AdapterConfig(rank=4, alpha=8, init_lora_weights=False, dropout=0.1)
    (seq, _), (grp, adapters) = _layers(layout, cfg)
    assert type(grp.experts) is G.GroupedExperts and type(seq.experts) is not G.GroupedExperts
    calls = []
    for mlp in grp.experts.local_experts:
        mlp.register_forward_hook(lambda *a: calls.append(1))
    grouped_calls = []
    real = G.grouped_mm
    G.grouped_mm = lambda *a, **k: grouped_calls.append(1) or real(*a, **k)
    try:
        x = torch.randn(SEQ, BATCH, H, generator=torch.Generator().manual_seed(1))
        out_g, gx_g = _run(grp, x)
    finally:
        G.grouped_mm = real
    out_s, gx_s = _run(seq, x)
    assert not calls, "grouped experts called a per-expert MLP forward"
    assert len(grouped_calls) >= 2  # fc1 and fc2 forward (backward adds more)
    torch.testing.assert_close(out_g, out_s, rtol=0, atol=1e-5)
    torch.testing.assert_close(gx_g, gx_s, rtol=0, atol=1e-5)
    for name in ("linear_fc1", "linear_fc2"):
        weights = [getattr(m, name).base_layer.weight for m in grp.experts.local_experts]
        assert G.shared_stack(weights) is not None, f"{name} weights not in one buffer"
    grp.experts.double()  # new storage for every parameter: re-tied after _apply
    weights = [m.linear_fc1.base_layer.weight for m in grp.experts.local_experts]
    assert weights[0].dtype == torch.float64 and G.shared_stack(weights) is not None
    # A parameter with storage of its own falls back to a stacked copy (still exact).
    weights[1].data = weights[1].data.clone()
    assert G.shared_stack(weights) is None
    torch.testing.assert_close(G.stacked(weights)[1], weights[1].detach())


@multirank(world_size=2, timeout=300)
def test_mixed_and_merged_adapters_fall_back_exactly(layout=ParallelLayout(ep=2)):
    import torch

    from megatron_lora.lora import AdapterConfig
    from tests.lora._moe_support import BATCH, H, SEQ

    def per_expert(name):  # a rank pattern: odd experts get rank 2, the rest (and router) 4
        odd = ".experts." in name and int(name.split(".experts.")[1].split(".")[0]) % 2
        return AdapterConfig(rank=2 if odd else 4, alpha=8, init_lora_weights=False,
                             dropout=0.2, use_rslora=True)

    x = torch.randn(SEQ, BATCH, H, generator=torch.Generator().manual_seed(2))
    (seq, ads_s), (grp, ads_g) = _layers(layout, per_expert)
    (out_g, gx_g), (out_s, gx_s) = _run(grp, x), _run(seq, x)
    torch.testing.assert_close(out_g, out_s, rtol=0, atol=1e-5)
    torch.testing.assert_close(gx_g, gx_s, rtol=0, atol=1e-5)
    for a, b in zip(ads_g, ads_s):
        torch.testing.assert_close(a.lora_A.grad, b.lora_A.grad, rtol=0, atol=1e-5)
        torch.testing.assert_close(a.lora_B.grad, b.lora_B.grad, rtol=0, atol=1e-5)
    # Merged: the LoRA term lives in the (shared-buffer) base weights; eval outputs agree.
    grp.eval()
    seq.eval()
    with torch.no_grad():
        before, _ = grp(x)
        for ad in ads_g:
            ad.merge()
        merged, _ = grp(x)
        reference, _ = seq(x)
        for ad in ads_g:
            ad.unmerge()
        after, _ = grp(x)
    torch.testing.assert_close(merged, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(before, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-5)
