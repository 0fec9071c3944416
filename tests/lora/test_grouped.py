"""Stacked expert LoRA (ExpertLora.grouped: one grouped matmul per factor over the
tokens-per-expert split) equals per-expert adapters (LoraAdapter on each expert's megatron
linear) for the same global adapters: outputs, input gradients and factor gradients, fp32,
for E in {1, 4, 8} local experts including experts that receive zero tokens, at expert-TP 2 (fc1
B strided, fc2 partial sums); and against plain torch with dropout and rsLoRA."""

import pytest
import torch

from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank

H, FFN, RANK = 16, 24, 4
COUNTS = {1: [7], 4: [3, 0, 5, 2], 8: [0, 4, 0, 0, 6, 1, 0, 3]}


def _chain(fin: int, fout: int, rows: int) -> int:
    """Roundings along the longest chain of any compared quantity of an adapter fin -> fout over
    `rows` tokens: the down sum (fin), the up sum (RANK), the gradients' sums over fout and the
    rows, the scale, dropout's 1 / (1 - p) and mask products, an all-reduce over 2 ranks."""
    return fin + fout + RANK + rows + 6


def _judge(checks, shadows, n, name, problems):
    """Each (got, want) of `checks` within shadow_bound(n, shadows[what]); failures (the worst
    element, its index and the bound) go to `problems`."""
    from tests.lora._bounds import judge, shadow_bound

    for what, (got, want) in checks.items():
        why = judge(got.detach(), want.detach(), shadow_bound(n, shadows[what]), f"{name} {what}")
        if why:
            problems.append(why)


def _loop(x, w, counts, scale):
    """The plain-torch reference: scale x_e w_e^T per group of rows."""
    parts, start = [], 0
    for e, n in enumerate(counts):
        parts.append(scale * x[start:start + n] @ w[e].t())
        start += n
    return torch.cat(parts)


@pytest.mark.parametrize("kernel", [False, True], ids=["loop", "grouped_mm"])
def test_grouped_matmul_matches_a_loop_with_empty_groups(kernel, monkeypatch):
    """Both paths: the loop (CPU's) and torch._grouped_mm (CUDA's, forced here on CPU, where
    torch runs it too, so its operand layout is checked without a GPU)."""
    from megatron_lora.lora import grouped as G
    from megatron_lora.lora.grouped import grouped_linear

    calls = []
    if kernel:
        real = torch._grouped_mm
        monkeypatch.setattr(G, "_grouped_kernel", lambda x: x.shape[0] > 0)
        monkeypatch.setattr(torch, "_grouped_mm",
                            lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(0)
    counts = [0, 5, 0, 3]
    for k, m in ((16, 4), (6, 3)):  # aligned (grouped kernel) and unaligned (loop) shapes
        x = torch.randn(8, k, generator=g, requires_grad=True)
        w = torch.randn(4, m, k, generator=g, requires_grad=True)
        y = grouped_linear(x, w, counts, scale=0.5)
        ref = _loop(x, w, counts, 0.5)
        gy = torch.randn_like(y)
        gx, gw = torch.autograd.grad(y, (x, w), gy)
        rx, rw = torch.autograd.grad(ref, (x, w), gy)
        # S: the loop on |x|, |w| and |gy| (a linear graph with a positive scale)
        ax, aw = x.detach().abs().requires_grad_(), w.detach().abs().requires_grad_()
        shadow = _loop(ax, aw, counts, 0.5)
        sx, sw = torch.autograd.grad(shadow, (ax, aw), gy.abs())
        problems = []
        _judge({"output": (y, ref), "grad_input": (gx, rx), "grad_weight": (gw, rw)},
               {"output": shadow, "grad_input": sx, "grad_weight": sw}, k + m + max(counts) + 2,
               f"k={k}", problems)
        assert not problems, problems
        assert gw[0].abs().max() == 0 and gw[2].abs().max() == 0  # experts with no tokens
    assert bool(calls) == kernel  # the forced kernel really ran (aligned shapes)


def test_strided_shards_reassemble_to_the_global_tensor():
    from megatron_lora.lora.factors import shard_like_base as _shard
    from megatron_lora.lora.gather import unstride

    t = torch.arange(48.0).reshape(24, 2)
    for size in (1, 2, 4):
        for stride in (1, 2):
            parts = [_shard(t, 0, size, k, stride) for k in range(size)]
            assert torch.equal(unstride(parts, 0, stride), t)
    # stride 2 at size 2: rank 0 holds [gate_0; up_0] = rows 0-5 and 12-17
    assert torch.equal(_shard(t, 0, 2, 0, 2), torch.cat([t[0:6], t[12:18]]))


def expert_bases(kind: str, num: int, group, fin: int, fout: int):
    """`num` megatron expert linears of `kind` (fc1: column, stride 2; fc2: row) over `group`
    (global sizes fin -> fout), zero weights."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    t = group.size()
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, use_cpu_initialization=True,
        expert_tensor_parallel_size=t, num_moe_experts=8, add_bias_linear=False,
    )
    init = torch.nn.init.zeros_
    if kind == "linear_fc1":
        return [ColumnParallelLinear(fin, fout, config=config, init_method=init, bias=False,
                                     is_expert=True, tp_group=group, stride=2)
                for _ in range(num)]
    return [RowParallelLinear(fin, fout, config=config, init_method=init, bias=False,
                              input_is_parallel=True, skip_bias_add=True, is_expert=True,
                              tp_group=group) for _ in range(num)]


def _abs_run(adapters, x, counts, gy):
    """The shadow S of each quantity of test_grouped_equals_per_expert_adapters: `adapters`'
    factors made |A|, |B|, run on |x| per expert with output gradient |gy|."""
    xs = x.abs().requires_grad_(True)
    with torch.no_grad():
        for ad in adapters:
            ad.lora_A.abs_()
            ad.lora_B.abs_()
    outs, start = [], 0
    for ad, n in zip(adapters, counts):
        outs.append(ad.lora_delta(xs[start:start + n]))
        start += n
    y = torch.cat(outs)
    y.backward(gy.abs())
    return {"output": y.detach(), "grad_input": xs.grad,
            "lora_A": torch.stack([ad.lora_A.grad for ad in adapters]),
            "lora_B": torch.stack([ad.lora_B.grad for ad in adapters])}


def stacked_lora(kind, bases, cfg, seeds, first=0):
    from megatron_lora.lora.expert_lora import ExpertLora

    names = [f"decoder.layers.0.mlp.experts.{first + e}.{kind}" for e in range(len(bases))]
    return ExpertLora(kind, bases, [cfg] * len(bases), seeds, names=names, first_expert=first)


@pytest.mark.parametrize("layout", [ParallelLayout(ep=1, etp=2)], ids=["ETP2"])
@multirank(world_size=2, timeout=300)
def test_grouped_equals_per_expert_adapters(layout):
    from megatron.core import parallel_state as ps

    from megatron_lora.lora import AdapterConfig, LoraAdapter

    group = ps.get_expert_tensor_parallel_group()
    cfg = AdapterConfig(rank=RANK, alpha=8.0, init_lora_weights=False)
    problems = []
    for num, counts in COUNTS.items():
        seeds = {kind: [1000 * i + (1 if kind == "linear_fc1" else 2) for i in range(num)]
                 for kind in ("linear_fc1", "linear_fc2")}
        sizes = {"linear_fc1": (H, 2 * FFN), "linear_fc2": (FFN, H)}
        bases = {kind: expert_bases(kind, num, group, *sizes[kind]) for kind in sizes}
        g = torch.Generator().manual_seed(num)
        for kind in ("linear_fc1", "linear_fc2"):
            per = [LoraAdapter(b, cfg, seed=s) for b, s in zip(bases[kind], seeds[kind])]
            grouped = stacked_lora(kind, expert_bases(kind, num, group, *sizes[kind]), cfg,
                                   seeds[kind])
            in_local = H if kind == "linear_fc1" else FFN // 2
            x = torch.randn(sum(counts), in_local, generator=g)
            x1 = x.clone().requires_grad_(True)
            x2 = x.clone().requires_grad_(True)
            outs, start = [], 0
            for ad, n in zip(per, counts):
                outs.append(ad.lora_delta(x1[start:start + n]))
                start += n
            y1 = torch.cat(outs)
            y2 = grouped.grouped(x2, counts)
            gy = torch.randn(y1.shape, generator=g)
            y1.backward(gy)
            y2.backward(gy)
            name = f"E={num}/{kind}"
            checks = {
                "output": (y2, y1), "grad_input": (x2.grad, x1.grad),
                "lora_A": (grouped.lora_A.grad, torch.stack([ad.lora_A.grad for ad in per])),
                "lora_B": (grouped.lora_B.grad, torch.stack([ad.lora_B.grad for ad in per])),
            }
            # S: the per-expert adapters (same seeds) with |A|, |B| on |x| and |gy|, through
            # the same code (its all-reduces included)
            shadows = _abs_run([LoraAdapter(b, cfg, seed=s) for b, s in
                                zip(expert_bases(kind, num, group, *sizes[kind]), seeds[kind])],
                               x, counts, gy)
            _judge(checks, shadows, _chain(*sizes[kind], max(counts)), name, problems)
            # the same seeds give the same factors: bit-identical
            factors = torch.stack([ad.lora_B.detach() for ad in per])
            if not torch.equal(factors, grouped.lora_B.detach()):
                problems.append(f"{name}: lora_B differs from the per-expert adapters'")
            if any(n == 0 for n in counts) and grouped.lora_B.grad.abs().sum() == 0:
                problems.append(f"{name}: no gradient at all")
    assert not problems, problems


@pytest.mark.parametrize("layout", [ParallelLayout(ep=1, etp=2)], ids=["ETP2"])
@multirank(world_size=2, timeout=300)
def test_grouped_dropout_and_rslora_match_the_global_mask_reference(layout):
    """Dropout 0.3 + rsLoRA, rows in dispatcher order (arbitrary global token indices, an empty
    expert), local experts 4..7 of 8: at expert-TP 1 and 2 under the same key, output, input
    gradient and factor gradients equal plain torch built from the global factors, the scale
    alpha / sqrt(r) and the documented mask keep_mask_at(sub_key(key, 2 g + j), token, feature)
    over GLOBAL features (fc2's rank k sees features k f/t ..)."""
    import math

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_lora.lora import AdapterConfig, init_global_factors
    from megatron_lora.lora.factors import shard_like_base as _shard
    from megatron_lora.lora.dropout import keep_mask_at, sub_key
    group = ps.get_expert_tensor_parallel_group()
    # One-rank groups (each rank's own) for the expert-TP 1 case; created by every rank.
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    p, alpha, first = 0.3, 8.0, 4
    cfg = AdapterConfig(rank=RANK, alpha=alpha, dropout=p, use_rslora=True,
                        init_lora_weights=False)
    scale = alpha / math.sqrt(RANK)
    counts = [3, 0, 5, 2]
    g = torch.Generator().manual_seed(3)
    token_ids = torch.randperm(64, generator=g)[: sum(counts)]
    key = torch.tensor([123457, 765431], dtype=torch.int64)
    problems = []
    for j, (kind, fin, fout) in enumerate((("linear_fc1", H, 2 * FFN), ("linear_fc2", FFN, H))):
        seeds = [97 * (first + e) + j for e in range(len(counts))]
        x = torch.randn(sum(counts), fin, generator=g)
        gy = torch.randn(sum(counts), fout, generator=g)
        # reference over the global tensors; and S, the same on |x|, |A|, |B| and |gy|
        def reference(x, gy, signed):
            xr = x.clone().requires_grad_(True)
            leaves, outs, start = [], [], 0
            for e, n in enumerate(counts):
                a, b = init_global_factors(cfg, fin, fout, seeds[e])
                a, b = (a, b) if signed else (a.abs(), b.abs())
                a.requires_grad_(True)
                b.requires_grad_(True)
                leaves.append((a, b))
                rows = slice(start, start + n)
                mask = keep_mask_at(sub_key(key, 2 * (first + e) + j), p, token_ids[rows], 0, fin)
                outs.append(scale * ((xr[rows] * mask / (1 - p)) @ a.t()) @ b.t())
                start += n
            ref = torch.cat(outs)
            ref.backward(gy)
            return (ref.detach(), xr.grad, torch.stack([a.grad for a, _ in leaves]),
                    torch.stack([b.grad for _, b in leaves]))

        ref, ref_gx, ref_ga, ref_gb = reference(x, gy, True)
        s_out, s_gx, s_ga, s_gb = reference(x.abs(), gy.abs(), False)
        for tp_group in (solo, group):
            t, k = tp_group.size(), tp_group.rank()
            module = stacked_lora(kind, expert_bases(kind, len(counts), tp_group, fin, fout), cfg,
                                  seeds, first)
            module.train()
            xl = (x if j == 0 else _shard(x, 1, t, k)).clone().requires_grad_(True)
            y = module.grouped(xl, counts, token_ids=token_ids, key=key)
            y.backward(_shard(gy, 1, t, k, 2) if j == 0 else gy)
            gx = xl.grad.clone()
            if j == 0:  # fc1: the input gradient is partial over expert-TP (B sharded)
                if t > 1:
                    dist.all_reduce(gx, group=tp_group)
                checks = {"output": (y, _shard(ref, 1, t, k, 2)), "grad_input": (gx, ref_gx),
                          "grad_A": (module.lora_A.grad, ref_ga),
                          "grad_B": (module.lora_B.grad, _shard(ref_gb, 1, t, k, 2))}
                shadows = {"output": _shard(s_out, 1, t, k, 2), "grad_input": s_gx,
                           "grad_A": s_ga, "grad_B": _shard(s_gb, 1, t, k, 2)}
            else:  # fc2: the output is partial over expert-TP (A sharded on features)
                y_full = y.detach().clone()
                if t > 1:
                    dist.all_reduce(y_full, group=tp_group)
                checks = {"output": (y_full, ref), "grad_input": (gx, _shard(ref_gx, 1, t, k)),
                          "grad_A": (module.lora_A.grad, _shard(ref_ga, 2, t, k)),
                          "grad_B": (module.lora_B.grad, ref_gb)}
                shadows = {"output": s_out, "grad_input": _shard(s_gx, 1, t, k),
                           "grad_A": _shard(s_ga, 2, t, k), "grad_B": s_gb}
            _judge(checks, shadows, _chain(fin, fout, max(counts)), f"{kind} ETP{t}", problems)
    assert not problems, problems
