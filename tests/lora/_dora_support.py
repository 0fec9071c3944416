"""DoRA parity helpers: a DoRA-wrapped megatron linear (dense) or MoE layer (experts) at one layout
against a plain-torch single-process reference built from the global weights.

The reference is PEFT's DoraLinearLayer formula written out on global tensors, never the code
under test: n = ||W + s B A||_row (detached), out = base(x) + (m/n - 1) * W d + (m/n) s B A d,
d = dropout(x) under the documented global mask (d = x without dropout, and then W d is the base
output without its bias). m is the global magnitude: its initial value is checked to be n, then
it is multiplied by a known per-row factor (so m != n and m/n matters in every check).
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict

import torch
import torch.nn.functional as F

from megatron_lora.lora import AdapterConfig, LoraAdapter, draw_dropout_key, keep_mask
from megatron_lora.lora.factors import shard_like_base as _shard
from tests.lora import _support as S
from tests.lora._bounds import judge, shadow_bound

MAG_SEED = 21


def mag_factor(n: int, seed: int = MAG_SEED) -> torch.Tensor:
    """The global per-row factor the magnitude is multiplied by after initialisation."""
    g = torch.Generator().manual_seed(seed)
    return 1.0 + 0.5 * torch.rand(n, generator=g) - 0.25


def dora_scale(alpha: float, rank: int, rslora: bool) -> float:
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def row_norm(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
    return torch.linalg.norm(w.detach() + s * b.detach() @ a.detach(), dim=1)


def norm_shadow(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
    """S of a row norm n = sqrt(sum_j v_j^2), v = W + s B A: each v_j is off by at most
    gamma_(RANK+2) |v|_j, |v| = |W| + s |B| |A|, and the sum of squares by gamma_(k+2) sum |v|_j^2
    in any order (k terms), so n**2 by at most gamma * N**2 (N = the row norm of |v|) and n by
    that over 2n (the square root, to first order): S = N**2 / n."""
    big = row_norm(w.abs(), a.abs(), b.abs(), s)
    return big * big / row_norm(w, a, b, s)


# Roundings along the longest chain of a dense DoRA quantity: the LoRA chain of _support.CHAIN
# plus the row norm (IN + RANK), its square root, m / n, m / n - 1 and the merge's steps.
CHAIN = S.CHAIN + S.IN + S.RANK + 8


def run_dense_case(case: S.Case, tp: int, check_merge: bool = True,
                   during=contextlib.nullcontext) -> Dict[str, str]:
    """One dense DoRA case (the LoRA parity cases' layouts); {quantity: the worst element, its
    index and its bound} of the quantities over their bounds (tests/lora/_bounds.py).
    during(): a context the forward and backward run in (tests switch a reduction off there)."""
    config, base, _ = S.build(case, tp)
    col = case.mode == "column"
    cfg = AdapterConfig(rank=S.RANK, alpha=S.ALPHA, dropout=case.dropout,
                        init_lora_weights=False, use_rslora=case.rslora, use_dora=True)
    inner = base._inner[0] if case.te_style else base
    adapter = LoraAdapter(base, cfg, seed=11)
    if case.bias:
        inner.bias.requires_grad_(True)
    if case.train_base_weight:
        inner.weight.requires_grad_(True)
    s = dora_scale(S.ALPHA, S.RANK, case.rslora)
    w = S.gather(inner.weight, 0 if col else 1)
    a = adapter.lora_A.detach().clone() if col else S.gather(adapter.lora_A, 1)
    b = S.gather(adapter.lora_B, 0) if col else adapter.lora_B.detach().clone()
    n = row_norm(w, a, b, s)
    errors: Dict[str, str] = {}
    shadow = norm_shadow(w, a, b, s)
    why = judge(adapter.magnitude, S.shard(n, 0) if col else n,
                shadow_bound(CHAIN, S.shard(shadow, 0) if col else shadow), "dora/magnitude_init")
    if why:
        errors["magnitude_init"] = why
    factor = mag_factor(S.OUT)
    with torch.no_grad():
        adapter.magnitude.mul_(S.shard(factor, 0) if col else factor)
    m_global = n * factor

    x_global, g_out, _ = S.global_batch()
    x = S.local_input(case, x_global).clone().requires_grad_(True)
    model = adapter
    if case.ddp:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        model = DistributedDataParallel(config, DistributedDataParallelConfig(), module=adapter)
    rng = torch.get_rng_state()
    with during():
        out, bias_ret = model(x)
    key = None
    if case.dropout:
        after = torch.get_rng_state()
        torch.set_rng_state(rng)
        key = draw_dropout_key(torch.device("cpu"))
        torch.set_rng_state(after)
    total = out + bias_ret if (bias_ret is not None and not case.gather_output) else out
    term = (total * S.local_output(case, g_out)).sum()
    with during():
        term.backward()
    if case.ddp:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([model])
    else:
        S.finalize_tp_grads(adapter, config)

    # ---- reference on global tensors ----
    nrm = row_norm(w, a, b, s)  # detached, as in PEFT: a constant of the graph below
    mask = None
    if case.dropout:
        mask = keep_mask(key, case.dropout, 0, S.SEQ * S.BATCH, 0, S.IN).reshape(x_global.shape)

    def reference(wr, ar, br, mr, gb, xr, g_out, shadow=False):
        """PEFT's formula; shadow: the absolute-value graph ((m/n - 1) as m/n + 1)."""
        xd = xr if mask is None else xr * mask / (1.0 - case.dropout)
        ms = mr / nrm
        y = xr @ wr.t()
        added = gb if (case.bias and not case.skip_bias_add) else None
        base_out = y if added is None else y + added
        ref = (base_out + (ms + 1 if shadow else ms - 1) * (xd @ wr.t())
               + ms * s * ((xd @ ar.t()) @ br.t()))
        ref_total = (ref + gb if (case.bias and case.skip_bias_add and not case.gather_output)
                     else ref)
        (ref_total * g_out).sum().backward()
        merged = base_out + (ms + 1 if shadow else ms - 1) * y + ms * s * ((xr @ ar.t()) @ br.t())
        return ref, merged.detach()

    def leaves(sign):
        gb = None
        if case.bias:
            gb = S.gather(inner.bias, 0) if col else inner.bias.detach().clone()
        return [None if t is None else sign(t.detach().clone()).requires_grad_(True)
                for t in (w, a, b, m_global, gb, x_global)]

    wr, ar, br, mr, gb, xr = leaves(lambda t: t)
    ref, ref_merged = reference(wr, ar, br, mr, gb, xr, g_out)
    # The graph is sums and products with non-negative constants (the norm, s, 1 / (1 - p)): on
    # the leaves' absolute values it gives each compared element's sum of |terms| (_bounds.py).
    sw, sa, sb, sm, sgb, sx = leaves(torch.abs)
    abs_ref, abs_merged = reference(sw, sa, sb, sm, sgb, sx, g_out.abs(), shadow=True)

    def grad(p):
        return S._grad(p)

    def check(name, got, want, shadow):
        # The norm adds IN + RANK roundings (and a square root) to the LoRA chain; m / n, the
        # m / n - 1 and the merge add a few.
        why = judge(got, want, shadow_bound(CHAIN, shadow), f"dora/{name}")
        if why:
            errors[name] = why

    local_out, local_in = S.local_output, S.local_input
    check("output", out, local_out(case, ref), local_out(case, abs_ref))
    check("grad_input", x.grad, local_in(case, xr.grad), local_in(case, sx.grad))
    check("grad_A", grad(adapter.lora_A), ar.grad if col else S.shard(ar.grad, 1),
          sa.grad if col else S.shard(sa.grad, 1))
    check("grad_B", grad(adapter.lora_B), S.shard(br.grad, 0) if col else br.grad,
          S.shard(sb.grad, 0) if col else sb.grad)
    check("grad_magnitude", grad(adapter.magnitude), S.shard(mr.grad, 0) if col else mr.grad,
          S.shard(sm.grad, 0) if col else sm.grad)
    # megatron-core's frozen-weight column linear adds a non-skipped bias inside its autograd
    # function and returns no gradient for it (a megatron limitation, see _support.run_case).
    frozen_column_bias = col and not case.skip_bias_add and not case.train_base_weight
    if case.bias and gb.grad is not None and not frozen_column_bias:
        check("grad_bias", grad(inner.bias), S.shard(gb.grad, 0) if col else gb.grad,
              S.shard(sgb.grad, 0) if col else sgb.grad)
    if case.train_base_weight:
        check("grad_base_weight", grad(inner.weight), S.shard(wr.grad, 0 if col else 1),
              S.shard(sw.grad, 0 if col else 1))
    if check_merge and not case.ddp:
        merged, unmerged, w0 = _merge_and_unmerge(adapter, inner, case, x_global)
        check("merged_output", merged, local_out(case, ref_merged), local_out(case, abs_merged))
        # W -> m/n (W + s B A) -> that / (m/n) - s B A: roundings of terms of |W| + s |B| |A|.
        abs_delta = S.shard(w.abs() + s * b.abs() @ a.abs(), 0 if col else 1)
        check("unmerged_weight", unmerged, w0, abs_delta)
    return errors


def _merge_and_unmerge(adapter, inner, case, x_global):
    """(eval output of the merged base alone, the weight after unmerge, the weight before)."""
    adapter.eval()
    x = S.local_input(case, x_global)
    w0 = inner.weight.detach().clone()
    with torch.no_grad():
        adapter.merge()
        merged, _ = adapter(x)
        adapter.unmerge()
    adapter.train()
    return merged, inner.weight.detach().clone(), w0


__all__ = ["dora_scale", "mag_factor", "norm_shadow", "row_norm", "run_dense_case"]


# ------------------------------------------------------------------------------------------------
# experts: a DoRA MoE layer (router plain LoRA, every expert's fc1 / fc2 DoRA)
# ------------------------------------------------------------------------------------------------
def _moe_reference(weights, experts, router, x, grad_out, scale, drop):
    """tests/lora/_moe_support.reference with DoRA on the experts' fc1 / fc2."""
    from megatron_lora.lora.dropout import keep_mask_at, sub_key
    from tests.lora import _moe_support as M

    H, FFN, E, TOPK = M.H, M.FFN, M.E, M.TOPK
    ar, br = router
    tokens = x.reshape(-1, H)
    p, rkey, lkey = drop if drop is not None else (0.0, None, None)
    rmask = keep_mask(rkey, p, 0, tokens.shape[0], 0, H).float() if drop else None
    logits = tokens @ weights["router"].t() + scale * (M._drop(tokens, rmask, p) @ ar.t()) @ br.t()
    top, idx = torch.topk(logits, TOPK, dim=1)
    probs = torch.softmax(top, dim=-1)
    scores = torch.softmax(logits, dim=-1)
    routing = torch.zeros_like(logits).scatter(1, idx, 1.0)
    n = tokens.shape[0]
    aux = M.AUX_COEFF * E / (TOPK * n * n) * (scores.sum(0) * routing.sum(0)).sum()
    y = torch.zeros_like(tokens)

    def dora(xe, xd, w, a, b, m):
        ms = m / row_norm(w, a, b, scale)
        return xe @ w.t() + (ms - 1) * (xd @ w.t()) + ms * scale * ((xd @ a.t()) @ b.t())

    for e in range(E):
        a1, b1, m1, a2, b2, m2 = experts[e]
        rows, slot = (idx == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            y = y + 0.0 * sum(t.sum() for t in experts[e])
            continue
        k1 = keep_mask_at(sub_key(lkey, 2 * e), p, rows, 0, H).float() if drop else None
        k2 = keep_mask_at(sub_key(lkey, 2 * e + 1), p, rows, 0, FFN).float() if drop else None
        xe = tokens[rows]
        h1 = dora(xe, M._drop(xe, k1, p), weights["fc1"][e], a1, b1, m1)
        z = F.silu(h1[:, :FFN]) * h1[:, FFN:] * probs[rows, slot].unsqueeze(-1)
        y = y.index_add(0, rows, dora(z, M._drop(z, k2, p), weights["fc2"][e], a2, b2, m2))
    y = y.reshape(x.shape)
    return y, (y * grad_out).sum() + aux


def run_moe_dora_case(layout, dispatcher: str, *, dropout: float = 0.0, rslora: bool = False,
                      grouped: bool = False, during=contextlib.nullcontext) -> Dict[str, str]:
    """The MoE parity case of _moe_support.run_moe_case with DoRA expert adapters; returns
    {quantity: the worst element, its index and its bound} of those over their bounds (output,
    input gradient, every expert's A, B, m)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    from megatron_lora.lora.adapter import init_global_factors
    from tests.lora import _moe_support as M

    alpha = M.ALPHA / 2 if rslora else M.ALPHA
    scale = dora_scale(alpha, M.RANK, rslora)
    lora = AdapterConfig(rank=M.RANK, alpha=alpha, init_lora_weights=False, dropout=dropout,
                         use_rslora=rslora)
    dora_cfg = AdapterConfig(rank=M.RANK, alpha=alpha, init_lora_weights=False, dropout=dropout,
                             use_rslora=rslora, use_dora=True)
    weights = M.global_weights()
    config, layer, adapters, router_ad = M.build_layer(
        layout, dispatcher, weights, lambda name: lora if name.endswith("router") else dora_cfg,
        grouped=grouped)
    t, k = layer.experts.tp_group.size(), layer.experts.tp_group.rank()
    prefix = "decoder.layers.0.mlp.experts"
    expert_ref, errors = {}, {}
    for e in range(M.E):
        leaves = []
        for target, (i, o), w in (("linear_fc1", (M.H, 2 * M.FFN), weights["fc1"][e]),
                                  ("linear_fc2", (M.FFN, M.H), weights["fc2"][e])):
            name = f"{prefix}.{e}.{target}"
            a, b = init_global_factors(dora_cfg, i, o, M.seed_for(name))
            m = row_norm(w, a, b, scale) * mag_factor(o, seed=M.seed_for(name))
            leaves += [a.requires_grad_(True), b.requires_grad_(True), m.requires_grad_(True)]
        expert_ref[e] = leaves
    for ad in adapters:  # move every magnitude off its initial norm by the known factor
        fc1 = ad.global_name.endswith("linear_fc1")
        factor = mag_factor(2 * M.FFN if fc1 else M.H, seed=M.seed_for(ad.global_name))
        factors = init_global_factors(dora_cfg, *((M.H, 2 * M.FFN) if fc1 else (M.FFN, M.H)),
                                      M.seed_for(ad.global_name))
        w_e = weights["fc1" if fc1 else "fc2"][ad.global_expert]
        want = row_norm(w_e, *factors, scale)
        # The square root of a sum of H (fc1) or FFN (fc2) squares of elements of W + s B A
        # (RANK + 1 terms each), see norm_shadow.
        shadow = norm_shadow(w_e, *factors, scale)
        if fc1:
            want, shadow = _shard(want, 0, t, k, 2), _shard(shadow, 0, t, k, 2)
        why = judge(ad.magnitude, want, shadow_bound(M.FFN + M.RANK + 4, shadow),
                    f"dora-moe/{ad.global_name}.magnitude_init")
        if why:
            errors[f"{ad.global_name}.magnitude_init"] = why
        with torch.no_grad():
            ad.magnitude.mul_(_shard(factor, 0, t, k, 2) if fc1 else factor)

    model = DistributedDataParallel(config, DistributedDataParallelConfig(), module=layer)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    x_all, g_all = M.global_batch(dp)

    def local(tensor):
        return _shard(tensor, 0, tp, tp_rank) if layout.sp else tensor

    x = local(x_all[dp_rank]).clone().requires_grad_(True)
    clear_aux_losses_tracker()
    layer.train()
    rng = torch.get_rng_state()
    with during():
        out, _ = model(x)
    drop = None
    if dropout:
        after = torch.get_rng_state()
        torch.set_rng_state(rng)
        cpu = torch.device("cpu")
        drop = (dropout, draw_dropout_key(cpu), draw_dropout_key(cpu))
        torch.set_rng_state(after)
    with during():
        (out * local(g_all[dp_rank])).sum().backward()
    finalize_model_grads([model])

    ar, br = init_global_factors(lora, M.H, M.E, M.seed_for("router"))
    ar.requires_grad_(True)
    br.requires_grad_(True)
    xr = x_all.clone().requires_grad_(True)
    for r in range(dp):  # the router is plain LoRA: the same routing check as the LoRA case
        M.check_routing_margin(errors, weights, (ar, br), x_all[r], scale, drop)
    total, outs = 0.0, []
    for r in range(dp):
        y, loss = _moe_reference(weights, expert_ref, (ar, br), xr[r], g_all[r], scale, drop)
        outs.append(y)
        total = total + loss
    total.backward()
    # Non-linear graph (softmax, SiLU, top-k weights): _moe_support's bounds, with the chain of
    # each expert linear longer by its row norm (2 FFN or H squares of RANK + 1 terms each).
    n = M.chain(dp) + 2 * M.FFN + M.RANK + 4
    M.check(errors, "output", out, local(outs[dp_rank]), n, "dora-moe")
    M.check(errors, "grad_input", x.grad, local(xr.grad[dp_rank]), n, "dora-moe")
    M.check(errors, "router.lora_B", M._grad(router_ad.lora_B), br.grad / dp, n, "dora-moe")
    held = torch.tensor([len(adapters)])
    dist.all_reduce(held)
    if held.item() != 2 * M.E * dist.get_world_size() // layout.ep:
        errors["checked_adapters"] = f"{held.item()} adapters in all"
    for ad in adapters:
        a1, b1, m1, a2, b2, m2 = expert_ref[ad.global_expert]
        if ad.global_name.endswith("linear_fc1"):
            want = (a1.grad, _shard(b1.grad, 0, t, k, 2), _shard(m1.grad, 0, t, k, 2))
        else:
            want = (_shard(a2.grad, 1, t, k), b2.grad, m2.grad)
        for name, param, w in zip(("lora_A", "lora_B", "magnitude"),
                                  ("lora_A", "lora_B", "lora_magnitude_vector"), want):
            M.check(errors, f"{ad.global_name}.{name}", ad.grad(param), w / dp, n, "dora-moe")
    return errors
