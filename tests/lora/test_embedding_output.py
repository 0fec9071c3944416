"""Embedding LoRA (VocabParallelEmbedding: vocab-sharded A, masked lookup, one [T, r] reduction)
and output-layer LoRA (column-parallel vocabulary projection, own or tied weight) equal a plain
torch reference from the same global weights: output, and gradients of A, B (after the TP step of
finalize_model_grads) and of the input, fp32, each element within 2 gamma_n S of the reference
(the shadow-graph bound of tests/lora/_bounds.py, see CHAIN), non-zero factors, at TP {1, 2, 4} with
and without SP, scale alpha / r, and again with rsLoRA (alpha / sqrt(r)) and dropout 0.25 in
training: the output layer's input masked by the documented global mask (token = position in
[s, b], feature = global hidden index) under the replayed key, the embedding unmasked (no dropout
on token ids, as documented). The scale is computed here from (alpha, r, use_rslora), never read
from an adapter. Also: disabling the embedding's [T, r] reduction breaks the comparison."""

import math

import pytest
import torch

from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank

V, H, SEQ, BATCH, RANK = 64, 24, 8, 2, 4
# Roundings along the longest chain of any compared element: a gradient of A or B sums over the
# SEQ * BATCH tokens; the input gradient sums over V logits then over RANK; a logit over H and
# over RANK; a few adds, scales and the dropout rescale.
CHAIN = SEQ * BATCH + V + H + RANK + 4


def _run(tp: int, sp: bool, tied: bool, drop: bool = False):
    from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_lora.lora import AdapterConfig, draw_dropout_key, keep_mask
    from megatron_lora.lora.embedding import wrap_embedding, wrap_output_layer
    from tests.lora._bounds import judge, shadow_bound
    from tests.lora._support import finalize_tp_grads, gather, shard

    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=4, tensor_model_parallel_size=tp,
        sequence_parallel=sp, use_cpu_initialization=True,
    )
    g = torch.Generator().manual_seed(1)
    w_emb = torch.randn(V, H, generator=g)
    w_out = w_emb if tied else torch.randn(V, H, generator=g)
    ids = torch.randint(0, V, (BATCH, SEQ), generator=g)
    g_emb = torch.randn(SEQ, BATCH, H, generator=g)
    h_out = torch.randn(SEQ, BATCH, H, generator=g)
    g_logits = torch.randn(SEQ, BATCH, V, generator=g) * 0.1
    alpha, p = 8.0, 0.25 if drop else 0.0
    cfg = AdapterConfig(rank=RANK, alpha=alpha, init_lora_weights=False, dropout=p,
                        use_rslora=drop)
    scale = alpha / math.sqrt(RANK) if drop else alpha / RANK

    emb = VocabParallelEmbedding(V, H, init_method=torch.nn.init.zeros_, config=config,
                                 reduce_scatter_embeddings=sp)
    out_layer = ColumnParallelLinear(H, V, config=config, init_method=torch.nn.init.zeros_,
                                     bias=False, gather_output=False,
                                     skip_weight_param_allocation=tied)
    with torch.no_grad():
        emb.weight.copy_(shard(w_emb, 0))
        if not tied:
            out_layer.weight.copy_(shard(w_out, 0))
    e_ad = wrap_embedding(emb, cfg, seed=11)
    o_ad = wrap_output_layer(out_layer, cfg, seed=12)

    assert e_ad.training and o_ad.training  # dropout, when configured, is active
    rng = torch.get_rng_state()
    y = e_ad(ids)  # [s/t, b, h] under SP, else [b, s, h]
    ge = shard(g_emb, 0) if sp else g_emb.transpose(0, 1)
    x = (shard(h_out, 0) if sp else h_out).clone().requires_grad_(True)
    logits, _ = o_ad(x, weight=emb.weight if tied else None)
    mask = torch.ones(SEQ, BATCH, H)
    if drop:  # the embedding draws no key; the output layer's is the first draw
        after = torch.get_rng_state()
        torch.set_rng_state(rng)
        key = draw_dropout_key(torch.device("cpu"))
        torch.set_rng_state(after)
        mask = keep_mask(key, p, 0, SEQ * BATCH, 0, H).float().reshape(SEQ, BATCH, H) / (1 - p)
    loss = (y * ge).sum() + (logits * shard(g_logits, 2)).sum()
    loss.backward()
    finalize_tp_grads(e_ad, config)
    finalize_tp_grads(o_ad, config)

    # reference (plain torch on the global tensors), and the same graph on the absolute values of
    # its leaves: every op is a lookup, sum or product with a non-negative constant (scale, the
    # 0/1 mask / (1 - p)), so each shadow element is the sum S of the absolute values of the
    # terms the compared element adds up. The layer computes the same terms in other orders
    # (sums split over TP ranks and all-reduced), so each element is within 2 gamma_n S of the
    # reference, n = CHAIN (tests/lora/_bounds.py).
    def reference(w_emb, w_out, ea, eb, oa, ob, xr, g_emb, g_logits):
        ry = (w_emb[ids] + scale * ea.t()[ids] @ eb.t()).transpose(0, 1)  # [s, b, h]
        rl = xr @ w_out.t() + scale * ((xr * mask) @ oa.t()) @ ob.t()
        ((ry * g_emb).sum() + (rl * g_logits).sum()).backward()
        return ry, rl

    def leaf(t):
        return t.detach().clone().requires_grad_(True)

    ea, eb = leaf(gather(e_ad.lora_A, 1)), leaf(e_ad.lora_B)
    oa, ob = leaf(o_ad.lora_A), leaf(gather(o_ad.lora_B, 0))
    xr = leaf(h_out)
    ry, rl = reference(w_emb, w_out, ea, eb, oa, ob, xr, g_emb, g_logits)
    sa = [leaf(t.abs()) for t in (ea, eb, oa, ob, xr)]
    sy, sl = reference(w_emb.abs(), w_out.abs(), *sa, g_emb.abs(), g_logits.abs())
    s_ea, s_eb, s_oa, s_ob, s_xr = sa

    def local_y(t):
        return shard(t, 0) if sp else t.transpose(0, 1)

    checks = {  # name: (layer's, reference's, shadow)
        "embedding.output": (y, local_y(ry), local_y(sy)),
        "embedding.grad_A": (e_ad.lora_A.grad, shard(ea.grad, 1), shard(s_ea.grad, 1)),
        "embedding.grad_B": (e_ad.lora_B.grad, eb.grad, s_eb.grad),
        "output_layer.logits": (logits, shard(rl, 2), shard(sl, 2)),
        "output_layer.grad_A": (o_ad.lora_A.grad, oa.grad, s_oa.grad),
        "output_layer.grad_B": (o_ad.lora_B.grad, shard(ob.grad, 0), shard(s_ob.grad, 0)),
        "output_layer.grad_input": (x.grad, shard(xr.grad, 0) if sp else xr.grad,
                                    shard(s_xr.grad, 0) if sp else s_xr.grad),
    }
    bad = {}
    for name, (got, want, shadow) in checks.items():
        why = judge(got, want, shadow_bound(CHAIN, shadow), name)
        if why:
            bad[name] = why
    return bad

@pytest.mark.parametrize("layout", [ParallelLayout(tp=1), ParallelLayout(tp=2),
                                    ParallelLayout(tp=4)], ids=["TP1", "TP2", "TP4"])
@multirank(world_size=lambda layout, **_: layout.tp, timeout=400)
def test_embedding_and_output_layer_match_reference(layout):
    from megatron_lora.lora import collectives as C
    from tests.lora._support import patched

    report = {}
    for sp in ([False, True] if layout.tp > 1 else [False]):
        for tied, drop in ((False, False), (True, False), (False, True)):
            bad = _run(layout.tp, sp, tied, drop)
            if bad:
                report[f"sp={sp}/tied={tied}" + ("/p0.25+rslora" if drop else "")] = bad
    if layout.tp > 1:  # the [T, r] reduction of the embedding's partial lookups matters
        with patched(C._AllReduce, "forward", lambda ctx, x, group: x.clone()):
            broken = _run(layout.tp, False, False)
        if "embedding.output" not in broken:
            report["no all-reduce"] = "went unnoticed"
    assert not report, report
