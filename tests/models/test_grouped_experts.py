"""GroupedExperts (models/grouped_experts.py): all local experts in one grouped matmul per weight
and LoRA factor, exact wherever SequentialMLP is.

- Layout parity: the LoRA-wrapped MoE layer built with GroupedExperts equals the plain-torch
  single-process reference of tests/lora/_moe_support.py (built from the global weights and the
  adapter config, never from the module under test): output, aux loss, input gradient, router and
  every expert adapter gradient, fp32, each within its bound (tests/lora/_bounds.py), non-zero
  factors, at EP / expert-TP / TP+SP,
  both dispatchers, through megatron DDP (expert-data-parallel gradients), with dropout 0.25 and
  rsLoRA on a subset.
- The grouped path really runs: no per-expert MLP forward is called, the weights share one
  buffer (also after `.to()`), and the grouped matmul is the one doing the work.
- Mixed adapters (a rank pattern giving experts different ranks) and merged adapters take the
  per-adapter fallback and still equal SequentialMLP with the same weights.
- Per-expert scales from LoraConfig's alpha_pattern (one rank) and rank_pattern + alpha_pattern,
  rsLoRA off and on, non-zero B: grouped and sequential experts equal a plain-torch reference
  that scales each expert by its own alpha / r (alpha / sqrt(r)), and each other at EP 2 and
  expert-TP 2 (outputs, input gradient, every adapter gradient). A grouped path that used expert
  0's scale for all experts leaves these by up to 250 (the older cases cannot see it: their
  experts share one scale or differ in rank).
- On CPU the experts run in cache-sized runs of whole experts (fc1 -> activation -> fc2 per run):
  the world-2 reference cases and the mixed-adapter fallback run one expert per run
  (CPU_CHUNK_BYTES = 1), the others all experts at once, so both paths meet the reference.
"""

import contextlib

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


@contextlib.contextmanager
def one_expert_per_run():
    """GroupedExperts on CPU with runs of one expert each (the rank processes are reused)."""
    from megatron_lora.models import grouped_experts as G

    saved, G.CPU_CHUNK_BYTES = G.CPU_CHUNK_BYTES, 1
    try:
        yield
    finally:
        G.CPU_CHUNK_BYTES = saved


@pytest.mark.parametrize("world_size", sorted(CASES), ids=lambda w: f"world{w}")
@multirank(world_size=lambda world_size, **_: world_size, timeout=600)
def test_grouped_moe_layer_matches_reference(world_size):
    from megatron_lora import runtime
    from tests.lora._moe_support import run_moe_case

    with one_expert_per_run() if world_size == 2 else contextlib.nullcontext():
        _reference_cases(world_size, runtime, run_moe_case)


def _reference_cases(world_size, runtime, run_moe_case):
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


def _close(got, want, what):
    """Two evaluation orders of the same MoE graph (grouped vs sequential experts): within
    _bounds.moe_bound of chain(1) (tests/lora/_moe_support.py; the input is one replica's); the
    failure names the worst element, its index and the bound."""
    from tests.lora._bounds import judge, moe_bound
    from tests.lora._moe_support import chain

    why = judge(got, want, moe_bound(want, chain(1)), what)
    assert why is None, why


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
    _close(out_g, out_s, "output (grouped vs sequential)")
    _close(gx_g, gx_s, "input gradient (grouped vs sequential)")
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
    with one_expert_per_run():
        out_g, gx_g = _run(grp, x)
    out_s, gx_s = _run(seq, x)
    _close(out_g, out_s, "output (grouped vs sequential)")
    _close(gx_g, gx_s, "input gradient (grouped vs sequential)")
    for a, b in zip(ads_g, ads_s):
        for name in ("lora_A", "lora_B"):
            _close(a.grad(name), b.grad(name), f"{a.global_name}.{name}")
    # Merged: the LoRA term lives in the (shared-buffer) base weights; eval outputs agree.
    grp.eval()
    seq.eval()
    with torch.no_grad():
        before, _ = grp(x)
        for ad in grp.experts.adapters.values():
            ad.merge()
        merged, _ = grp(x)
        reference, _ = seq(x)
        for ad in grp.experts.adapters.values():
            ad.unmerge()
        after, _ = grp(x)
    _close(merged, reference, "merged output")
    _close(before, reference, "output before merging")
    _close(after, before, "output after unmerging")


# ---- per-expert scales from LoraConfig's rank_pattern / alpha_pattern -------------------------
# Each case gives the layer's 8 experts different alphas (and, in the second, ranks). A whole
# model keeps one rank per adapter kind (lora/sizes.py), so the first case is what `train
# --lora-alpha-pattern` produces: one rank, per-expert scales, which the grouped path must not
# collapse into expert 0's. The router matches no pattern (r 4, alpha 8).
PATTERNS = {
    "alpha": ({}, {r"experts\.[1357]\.": 2.0, r"experts\.2\.": 24.0}),
    "rank+alpha": ({r"experts\.[1357]\.": 2, r"experts\.6\.": 8},
                   {r"experts\.[0-3]\.": 3.0, r"experts\.6\.": 32.0}),
}


def _expected(case, e):
    """(rank, alpha) of global expert e in a PATTERNS case, written out by hand (the first
    matching pattern wins), never read from LoraConfig or an adapter."""
    rank = {"alpha": 4, "rank+alpha": 2 if e % 2 else (8 if e == 6 else 4)}[case]
    alpha = {"alpha": 2.0 if e % 2 else (24.0 if e == 2 else 8.0),
             "rank+alpha": 3.0 if e <= 3 else (32.0 if e == 6 else 8.0)}[case]
    return rank, alpha


def _pattern_config(case, rslora, dropout=0.0):
    from megatron_lora.lora.model import LoraConfig

    ranks, alphas = PATTERNS[case]
    return LoraConfig(r=4, lora_alpha=8.0, lora_dropout=dropout, use_rslora=rslora,
                      init_lora_weights=False, rank_pattern=ranks, alpha_pattern=alphas,
                      target_modules=["linear_fc1", "linear_fc2", "router"])


def _scale(rank, alpha, rslora):
    import math

    return alpha / (math.sqrt(rank) if rslora else rank)


def _pattern_reference(case, rslora, weights, x, grad_out, drop):
    """Output, input gradient and {global adapter name: (grad A, grad B, A)} of the plain-torch
    MoE layer of tests/lora/_moe_support.py with each expert's own scale (folded into its B, the
    reference's common scale then 1), from the global weights."""
    from megatron_lora.lora import AdapterConfig
    from megatron_lora.lora.adapter import init_global_factors
    from tests.lora._moe_support import E, FFN, H, reference, seed_for

    leaves, experts = {}, {}
    for e in range(E):
        rank, alpha = _expected(case, e)
        cfg = AdapterConfig(rank=rank, alpha=alpha, init_lora_weights=False)
        factors = []
        for target, (i, o) in (("linear_fc1", (H, 2 * FFN)), ("linear_fc2", (FFN, H))):
            a, b = init_global_factors(cfg, i, o,
                                       seed_for(f"decoder.layers.0.mlp.experts.{e}.{target}"))
            a.requires_grad_(True)
            b.requires_grad_(True)
            leaves[f"decoder.layers.0.mlp.experts.{e}.{target}"] = (a, b)
            factors += [a, b * _scale(rank, alpha, rslora)]
        experts[e] = factors
    ar, br = init_global_factors(AdapterConfig(rank=4, alpha=8.0, init_lora_weights=False),
                                 H, E, seed_for("router"))
    ar.requires_grad_(True)
    br.requires_grad_(True)
    leaves["router"] = (ar, br)
    xr = x.clone().requires_grad_(True)
    y, _, loss = reference(weights, experts, (ar, br * _scale(4, 8.0, rslora)), xr, grad_out,
                           1.0, drop)
    loss.backward()
    return y.detach(), xr.grad, {n: (a.grad, b.grad, a.detach()) for n, (a, b) in leaves.items()}


@multirank(world_size=1, timeout=300)
def test_pattern_scales_per_expert_match_the_reference(layout=ParallelLayout()):
    """Grouped and sequential experts with per-expert alphas (and ranks) from the patterns,
    rsLoRA off and on, dropout 0 and 0.2, non-zero B: output, input gradient and every adapter
    gradient equal the plain-torch reference that scales each expert by its own
    alpha / r (alpha / sqrt(r)), each within _bounds.moe_bound of its largest entry (scales
    0.5 to 12 make some gradients O(10))."""
    import torch

    from megatron_lora.lora import draw_dropout_key
    from tests.lora._bounds import judge, moe_bound
    from tests.lora._moe_support import (BATCH, H, SEQ, build_layer, chain, factor_grad,
                                         global_weights)

    weights = global_weights()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(SEQ, BATCH, H, generator=g)
    grad_out = torch.randn(SEQ, BATCH, H, generator=g) * 0.1
    problems, checked = [], 0
    for case in PATTERNS:
        for rslora in (False, True):
            for dropout in (0.0, 0.2):
                config = _pattern_config(case, rslora, dropout)
                scales = {_scale(*_expected(case, e), rslora) for e in range(8)}
                assert len(scales) >= 3, scales  # the case really has per-expert scales
                for grouped in (True, False):
                    _, layer, adapters, router = build_layer(
                        layout, "allgather", weights, config.adapter_config, grouped=grouped)
                    layer.train()
                    xl = x.clone().requires_grad_(True)
                    state = torch.get_rng_state()
                    out, _ = layer(xl)
                    drop = None
                    if dropout:  # the keys the forward drew: the router's, then the layer's
                        after = torch.get_rng_state()
                        torch.set_rng_state(state)
                        cpu = torch.device("cpu")
                        drop = (dropout, draw_dropout_key(cpu), draw_dropout_key(cpu))
                        torch.set_rng_state(after)
                    (out * grad_out).sum().backward()
                    y, gx, ref = _pattern_reference(case, rslora, weights, x, grad_out, drop)
                    name = f"{case}/rslora={rslora}/p={dropout}/grouped={grouped}"
                    got = {"output": (out, y), "grad_input": (xl.grad, gx)}
                    for ad in adapters + [router]:
                        key = getattr(ad, "global_name", "router")
                        ga, gb, a = ref[key]
                        if not torch.equal(ad.lora_A.detach(), a):
                            problems.append(f"{name} {key}: A is not the reference's (rank?)")
                            continue
                        got[f"{key}.lora_A"] = (factor_grad(ad, "lora_A"), ga)
                        got[f"{key}.lora_B"] = (factor_grad(ad, "lora_B"), gb)
                    for what, (have, want) in got.items():
                        checked += 1
                        why = judge(have, want, moe_bound(want, chain(1)), f"{name} {what}")
                        if why:
                            problems.append(why)
    assert checked == 2 * 2 * 2 * 2 * (2 + 2 * 17)
    assert not problems, f"{len(problems)} of {checked} differ: {problems[:12]}"


@pytest.mark.parametrize("layout", [ParallelLayout(ep=2), ParallelLayout(etp=2)],
                         ids=["EP2", "ETP2"])
@multirank(world_size=2, timeout=300)
def test_pattern_scales_per_expert_grouped_equals_sequential(layout):
    """The same pattern cases at EP 2 (4 local experts a rank) and expert-TP 2: the grouped
    layer equals SequentialMLP with the same weights and adapters (output, input gradient,
    every local adapter's gradients), rsLoRA off and on, dropout 0.2."""
    import torch

    from tests.lora._bounds import judge, moe_bound
    from tests.lora._moe_support import BATCH, H, SEQ, chain

    x = torch.randn(SEQ, BATCH, H, generator=torch.Generator().manual_seed(6))
    problems = []
    for case in PATTERNS:
        for rslora in (False, True):
            config = _pattern_config(case, rslora, dropout=0.2)
            (seq, ads_s), (grp, ads_g) = _layers(layout, config.adapter_config)
            (out_g, gx_g), (out_s, gx_s) = _run(grp, x), _run(seq, x)
            got = {"output": (out_g, out_s), "grad_input": (gx_g, gx_s)}
            assert [a.global_name for a in ads_g] == [a.global_name for a in ads_s]
            for a, b in zip(ads_g, ads_s):
                got[f"{a.global_name}.lora_A"] = (a.grad("lora_A"), b.grad("lora_A"))
                got[f"{a.global_name}.lora_B"] = (a.grad("lora_B"), b.grad("lora_B"))
            for what, (have, want) in got.items():
                why = judge(have, want, moe_bound(want, chain(1)), f"{case}/rslora={rslora} {what}")
                if why:
                    problems.append(why)
    assert not problems, problems
