"""A LoRA-wrapped megatron MoE layer (router + SequentialMLP experts) at one layout against a
plain-torch single-process reference built from the same global weights.

`run_moe_case(layout, dispatcher)` (every rank of an initialised world) builds an MoELayer with a
load-balancing aux loss, puts known global weights into it, wraps the router and every expert's
fc1/fc2 with non-zero adapters, wraps it in megatron DDP, runs forward+backward on this rank's
part of a global batch (one sequence per data-parallel replica), calls finalize_model_grads, and
compares output, aux loss, input gradient and every adapter gradient with the reference (each
rank checks its own shards; the reference slices its global tensors the same way). Returns
{name: the worst element, its index and its bound} of the quantities over their bounds.

Bounds: the graph has non-linear steps (softmax, top-k weights, SiLU), so each quantity q is held
to compare.gradient_bound(q_ref, chain(dp)) (tests/lora/_bounds.py): two summation orders of
chain(dp)-term chains whose terms' absolute values add up to at most 100 max|q_ref|, with
probabilistic rounding (6 sqrt(n) u per chain). A missing or wrong reduction moves whole
gradients by O(max|q_ref|), far over it (tests/lora/test_moe_reductions_matter.py).

With dropout the reference rebuilds every mask from the documented definition in dropout.py:
router rows = the replica's token positions under the router's key; expert e's fc1 / fc2 rows =
the positions of the tokens routed to e under sub_key(layer key, 2 e) / (2 e + 1), features from
0 (fc2: of the global ffn). The keys are replayed from the generator state before the forward
(the router draws first, then the layer); the scale is alpha / r or alpha / sqrt(r), computed
here, never read from an adapter.
"""

from __future__ import annotations

import math
import zlib
from typing import Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from megatron_lora.lora import AdapterConfig, draw_dropout_key
from megatron_lora.lora.factors import shard_like_base as _shard
from megatron_lora.lora.dropout import keep_mask, keep_mask_at, sub_key
from megatron_lora.lora.experts import wrap_experts
from megatron_lora.lora.router import wrap_router
from tests.lora._bounds import judge, moe_bound, shadow_bound

H, FFN, E, TOPK, SEQ, BATCH, RANK = 32, 48, 8, 2, 8, 2, 4
AUX_COEFF = 0.1
ALPHA = 8.0


def chain(dp: int) -> int:
    """Roundings along the longest chain of any compared quantity (an upper bound for each):
    the router (H + RANK), fc1 (H + RANK), fc2 (FFN + RANK) and their backward (2 FFN + RANK,
    H + RANK, E + RANK), the TOPK combine, a factor gradient's or the aux loss's sum over the
    global batch's dp * SEQ * BATCH tokens, and a few adds, scales and softmax/SiLU roundings."""
    return dp * SEQ * BATCH + 2 * H + 3 * FFN + E + 6 * RANK + TOPK + 8


def seed_for(name: str) -> int:
    return zlib.crc32(name.encode())


def layer_config(layout, dispatcher: str):
    from megatron_lora.models.gpt import tiny_moe_shape, transformer_config

    shape = tiny_moe_shape(hidden_size=H, ffn_hidden_size=FFN, num_experts=E,
                               moe_router_topk=TOPK, num_layers=1)
    # calculate_per_token_loss=False: the aux-loss gradient then does not depend on how many
    # tokens a rank holds, so one reference serves every layout.
    return transformer_config(
        shape, layout, dispatcher=dispatcher, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=AUX_COEFF, calculate_per_token_loss=False,
    )


def global_weights(seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(E, H, generator=g) * 0.3,
        "fc1": torch.randn(E, 2 * FFN, H, generator=g) * 0.2,
        "fc2": torch.randn(E, H, FFN, generator=g) * 0.2,
    }


def global_batch(dp: int, seed: int = 9):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(dp, SEQ, BATCH, H, generator=g)
    # O(0.1) output gradients keep every gradient O(1).
    grad_out = torch.randn(dp, SEQ, BATCH, H, generator=g) * 0.1
    return x, grad_out


def build_layer(layout, dispatcher: str, weights, adapter_config: AdapterConfig, *,
                dense_expert_adapters: bool = False, grouped: bool = False):
    """MoELayer with the given global weights; router + all expert linears wrapped; grouped:
    GroupedExperts (models/grouped_experts.py) instead of SequentialMLP."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_lora.models.specs import local_layer_spec
    from megatron_lora.runtime.versions import spec_submodules

    config = layer_config(layout, dispatcher)
    spec = spec_submodules(local_layer_spec(E, moe_grouped_gemm=grouped)).mlp
    layer = MoELayer(config, submodules=spec_submodules(spec), layer_number=1)
    layer.set_layer_number(1)  # the router logs its aux loss under its layer number
    experts = layer.experts
    etp_group = experts.tp_group
    t, k = etp_group.size(), etp_group.rank()
    with torch.no_grad():
        layer.router.weight.copy_(weights["router"])
        for local, mlp in enumerate(experts.local_experts):
            e = experts.ep_group.rank() * experts.num_local_experts + local
            mlp.linear_fc1.weight.copy_(_shard(weights["fc1"][e], 0, t, k, 2))
            mlp.linear_fc2.weight.copy_(_shard(weights["fc2"][e], 1, t, k))
    prefix = "decoder.layers.0.mlp.experts"
    stacked = wrap_experts(experts, adapter_config, prefix=prefix, seed_for=seed_for,
                           moe_layer=layer)
    # One view per local expert and target: its pair and gradients as slices of the stacked ones.
    adapters = [view for lora in stacked for view in lora.experts()]
    router_config = (adapter_config if isinstance(adapter_config, AdapterConfig)
                     else adapter_config("decoder.layers.0.mlp.router"))  # a per-name config
    router_adapter = wrap_router(layer.router, router_config, seed=seed_for("router"))
    if dense_expert_adapters:  # the bug others shipped: expert adapters in the dense DP buffers
        for lora in stacked:
            lora.lora_A.allreduce = lora.lora_B.allreduce = True
    return config, layer, adapters, router_adapter


def _drop(t, mask, p):
    return t if mask is None else t * mask / (1.0 - p)


def reference(weights, adapters_global, router_factors, x, grad_out, scale, drop=None):
    """Plain torch, one DP replica: x [s, b, h] -> loss = <y, grad_out> + aux; returns the
    output, the aux loss and the graph leaves (autograd does the rest). drop: None or
    (p, router key, layer key): LoRA inputs masked by the documented global masks."""
    ar, br = router_factors
    tokens = x.reshape(-1, H)  # row i = global token i of this replica ([s, b] sequence-major)
    p, rkey, lkey = drop if drop is not None else (0.0, None, None)
    rmask = keep_mask(rkey, p, 0, tokens.shape[0], 0, H).float() if drop else None
    logits = tokens @ weights["router"].t() + scale * (_drop(tokens, rmask, p) @ ar.t()) @ br.t()
    top, idx = torch.topk(logits, TOPK, dim=1)
    probs = torch.softmax(top, dim=-1)
    scores = torch.softmax(logits, dim=-1)
    routing = torch.zeros_like(logits).scatter(1, idx, 1.0)
    n = tokens.shape[0]
    aux = AUX_COEFF * E / (TOPK * n * n) * (scores.sum(0) * routing.sum(0)).sum()
    y = torch.zeros_like(tokens)
    for e in range(E):
        a1, b1, a2, b2 = adapters_global[e]
        rows, slot = (idx == e).nonzero(as_tuple=True)
        if rows.numel() == 0:  # no token: keep the factors in the graph (zero gradients)
            y = y + 0.0 * (a1.sum() + b1.sum() + a2.sum() + b2.sum())
            continue
        m1 = keep_mask_at(sub_key(lkey, 2 * e), p, rows, 0, H).float() if drop else None
        m2 = keep_mask_at(sub_key(lkey, 2 * e + 1), p, rows, 0, FFN).float() if drop else None
        xe = tokens[rows]
        h1 = xe @ weights["fc1"][e].t() + scale * (_drop(xe, m1, p) @ a1.t()) @ b1.t()
        act = F.silu(h1[:, :FFN]) * h1[:, FFN:]
        z = act * probs[rows, slot].unsqueeze(-1)
        out = z @ weights["fc2"][e].t() + scale * (_drop(z, m2, p) @ a2.t()) @ b2.t()
        y = y.index_add(0, rows, out)
    y = y.reshape(x.shape)
    return y, aux, (y * grad_out).sum() + aux


def check_routing_margin(errors: Dict[str, str], weights, router_factors, x, scale,
                         drop=None) -> None:
    """errors["routing_margin"] = why, when a token's TOPK-th and next logit are closer than the
    logits' rounding allows: there the layer and the reference may route it to different
    experts, depending on summation order alone. A logit sums H + RANK products (and the LoRA
    scale, dropout rescale and an add): any order is within gamma_(H+RANK+4) S of it, S from the
    absolute values (tests/lora/_bounds.py), so a gap over the two logits' 2 gamma S bounds
    makes top-k the same in every order. x: one replica's [s, b, h]; drop as in reference()."""
    ar, br = (t.detach() for t in router_factors)
    tokens = x.detach().reshape(-1, H)
    p, rkey, _ = drop if drop is not None else (0.0, None, None)
    rmask = keep_mask(rkey, p, 0, tokens.shape[0], 0, H).float() if drop else None
    dropped = _drop(tokens, rmask, p)
    logits = tokens @ weights["router"].t() + scale * (dropped @ ar.t()) @ br.t()
    shadow = (tokens.abs() @ weights["router"].abs().t()
              + scale * (dropped.abs() @ ar.abs().t()) @ br.abs().t())
    bound = shadow_bound(H + RANK + 4, shadow).max(dim=1).values
    top = logits.double().sort(dim=1, descending=True).values
    ratio = (top[:, TOPK - 1] - top[:, TOPK]) / (2 * bound)
    token = int(ratio.argmin())
    if not float(ratio[token]) > 1:
        errors["routing_margin"] = (
            f"token {token}: top-{TOPK} boundary gap {float(ratio[token] * 2 * bound[token]):.3e}"
            f" <= 2 x logit bound {float(bound[token]):.3e}: routing depends on summation order")


def check(errors: Dict[str, str], name: str, got, want, n: int, kind: str = "moe") -> None:
    """errors[name] = why, when got is not within moe_bound(want, n) of want (the worst element,
    its index and the bound; tests/lora/_bounds.py)."""
    why = judge(got, want, moe_bound(want, n), f"{kind}/{name}")
    if why:
        errors[name] = why


def factor_grad(adapter, name: str):
    """The gradient of an adapter's factor `name`: an expert view's slice of the stacked
    gradient, else the parameter's (main_grad under megatron DDP)."""
    if hasattr(adapter, "grad") and callable(adapter.grad):
        return adapter.grad(name)
    return _grad(getattr(adapter, name))


def _grad(p):
    return p.main_grad if getattr(p, "main_grad", None) is not None else p.grad


def run_moe_case(layout, dispatcher: str, *, dense_expert_adapters: bool = False,
                 with_aux: bool = True, dropout: float = 0.0,
                 rslora: bool = False, grouped: bool = False) -> Dict[str, float]:
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    # rsLoRA with alpha / 2: the same scale as alpha / r (2 at r = 4), so the fp32 error budget
    # stays the one of the plain cases, while a scale of alpha / r (1) would be far off.
    alpha = ALPHA / 2 if rslora else ALPHA
    cfg = AdapterConfig(rank=RANK, alpha=alpha, init_lora_weights=False, dropout=dropout,
                        use_rslora=rslora)
    scale = alpha / math.sqrt(RANK) if rslora else alpha / RANK
    weights = global_weights()
    config, layer, adapters, router_ad = build_layer(
        layout, dispatcher, weights, cfg, dense_expert_adapters=dense_expert_adapters,
        grouped=grouped)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), module=layer)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    x_all, g_all = global_batch(dp)

    def local(t):  # this rank's sequence shard of its replica's [s, b, h]
        return _shard(t, 0, tp, tp_rank) if layout.sp else t

    x = local(x_all[dp_rank]).clone().requires_grad_(True)
    clear_aux_losses_tracker()
    layer.train()
    rng = torch.get_rng_state()
    out, _ = model(x)
    drop: Optional[tuple] = None
    if dropout:  # replay the draws: the router's key, then the MoE layer's (experts)
        after = torch.get_rng_state()
        torch.set_rng_state(rng)
        cpu = torch.device("cpu")
        drop = (dropout, draw_dropout_key(cpu), draw_dropout_key(cpu))
        torch.set_rng_state(after)
    (out * local(g_all[dp_rank])).sum().backward()
    finalize_model_grads([model])
    tracker = get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
    aux = tracker[0].detach().clone() * AUX_COEFF
    if tp > 1:
        dist.all_reduce(aux, group=ps.get_tensor_model_parallel_group())

    # ---- reference over the global batch (every replica), from global factors ----
    from megatron_lora.lora.adapter import init_global_factors

    expert_ref = {}
    for e in range(E):
        leaves = []
        for target, (i, o) in (("linear_fc1", (H, 2 * FFN)), ("linear_fc2", (FFN, H))):
            a, b = init_global_factors(cfg, i, o, seed_for(f"decoder.layers.0.mlp.experts.{e}.{target}"))
            leaves += [a.requires_grad_(True), b.requires_grad_(True)]
        expert_ref[e] = leaves
    ar, br = init_global_factors(cfg, H, E, seed_for("router"))
    ar.requires_grad_(True)
    br.requires_grad_(True)
    xr = x_all.clone().requires_grad_(True)
    total = 0.0
    outs, auxes = [], []
    for r in range(dp):
        y, aux_r, loss = reference(weights, expert_ref, (ar, br), xr[r], g_all[r], scale, drop)
        outs.append(y)
        auxes.append(aux_r)
        total = total + loss
    total.backward()

    errors: Dict[str, str] = {}
    for r in range(dp):  # routing is order-independent (else the comparison below means nothing)
        check_routing_margin(errors, weights, (ar, br), x_all[r], scale, drop)
    n = chain(dp)
    check(errors, "output", out, local(outs[dp_rank]), n)
    if with_aux:
        check(errors, "aux_loss", aux, auxes[dp_rank].detach(), n)
    check(errors, "grad_input", x.grad, local(xr.grad[dp_rank]), n)
    check(errors, "router.lora_A", _grad(router_ad.lora_A), ar.grad / dp, n)
    check(errors, "router.lora_B", _grad(router_ad.lora_B), br.grad / dp, n)
    t, k = layer.experts.tp_group.size(), layer.experts.tp_group.rank()
    # Every rank must check its own experts' adapters, and together all of them: each of the E
    # experts' 2 adapters lives on expert-TP ranks of every expert-data-parallel replica.
    held = torch.tensor([len(adapters)])
    dist.all_reduce(held)
    world = dist.get_world_size()
    expected = 2 * E * world // layout.ep
    if len(adapters) != 2 * layer.experts.num_local_experts or held.item() != expected:
        errors["checked_adapters"] = f"{len(adapters)} adapters here, {held.item()} in all"
    for ad in adapters:
        a1, b1, a2, b2 = expert_ref[ad.global_expert]
        if ad.global_name.endswith("linear_fc1"):
            want_a, want_b = a1.grad, _shard(b1.grad, 0, t, k, 2)
            value_ok = torch.equal(ad.lora_A.detach(), a1.detach())
        else:
            want_a, want_b = _shard(a2.grad, 1, t, k), b2.grad
            value_ok = torch.equal(ad.lora_B.detach(), b2.detach())
        check(errors, f"{ad.global_name}.lora_A", ad.grad("lora_A"), want_a / dp, n)
        check(errors, f"{ad.global_name}.lora_B", ad.grad("lora_B"), want_b / dp, n)
        if not value_ok:
            errors[f"{ad.global_name}.init"] = "the initial factors are not the reference's"
    return errors
