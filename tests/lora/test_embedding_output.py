"""Embedding LoRA (VocabParallelEmbedding: vocab-sharded A, masked lookup, one [T, r] reduction)
and output-layer LoRA (column-parallel vocabulary projection, own or tied weight) equal a plain
torch reference from the same global weights: output, and gradients of A, B (after the TP step of
finalize_model_grads) and of the input, fp32, atol 1e-5, non-zero factors, at TP {1, 2, 4} with
and without SP. Also: disabling the embedding's [T, r] reduction breaks the comparison."""

import pytest
import torch

from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank

V, H, SEQ, BATCH, RANK = 64, 24, 8, 2, 4


def _run(tp: int, sp: bool, tied: bool):
    from megatron.core.tensor_parallel import ColumnParallelLinear, VocabParallelEmbedding
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_lora.lora import AdapterConfig
    from megatron_lora.lora.embedding import wrap_embedding, wrap_output_layer
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
    cfg = AdapterConfig(rank=RANK, alpha=8.0, init_lora_weights=False)

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

    y = e_ad(ids)  # [s/t, b, h] under SP, else [b, s, h]
    ge = shard(g_emb, 0) if sp else g_emb.transpose(0, 1)
    x = (shard(h_out, 0) if sp else h_out).clone().requires_grad_(True)
    logits, _ = o_ad(x, weight=emb.weight if tied else None)
    loss = (y * ge).sum() + (logits * shard(g_logits, 2)).sum()
    loss.backward()
    finalize_tp_grads(e_ad, config)
    finalize_tp_grads(o_ad, config)

    # reference
    ea = gather(e_ad.lora_A, 1).requires_grad_(True)
    eb = e_ad.lora_B.detach().clone().requires_grad_(True)
    oa = o_ad.lora_A.detach().clone().requires_grad_(True)
    ob = gather(o_ad.lora_B, 0).requires_grad_(True)
    xr = h_out.clone().requires_grad_(True)
    ry = (w_emb[ids] + cfg.scaling * ea.t()[ids] @ eb.t()).transpose(0, 1)  # [s, b, h]
    rl = xr @ w_out.t() + cfg.scaling * (xr @ oa.t()) @ ob.t()
    ((ry * g_emb).sum() + (rl * g_logits).sum()).backward()
    want_y = shard(ry, 0) if sp else ry.transpose(0, 1)
    checks = {
        "embedding.output": (y, want_y),
        "embedding.grad_A": (e_ad.lora_A.grad, shard(ea.grad, 1)),
        "embedding.grad_B": (e_ad.lora_B.grad, eb.grad),
        "output_layer.logits": (logits, shard(rl, 2)),
        "output_layer.grad_A": (o_ad.lora_A.grad, oa.grad),
        "output_layer.grad_B": (o_ad.lora_B.grad, shard(ob.grad, 0)),
        "output_layer.grad_input": (x.grad, shard(xr.grad, 0) if sp else xr.grad),
    }
    return {k: (a - b).abs().max().item() for k, (a, b) in checks.items()
            if not (a.shape == b.shape and (a - b).abs().max().item() <= 1e-5)}


@pytest.mark.parametrize("layout", [ParallelLayout(tp=1), ParallelLayout(tp=2),
                                    ParallelLayout(tp=4)], ids=["TP1", "TP2", "TP4"])
@multirank(world_size=lambda layout, **_: layout.tp, timeout=400)
def test_embedding_and_output_layer_match_reference(layout):
    from megatron_lora.lora import collectives as C
    from tests.lora._support import patched

    report = {}
    for sp in ([False, True] if layout.tp > 1 else [False]):
        for tied in (False, True):
            bad = _run(layout.tp, sp, tied)
            if bad:
                report[f"sp={sp}/tied={tied}"] = bad
    if layout.tp > 1:  # the [T, r] reduction of the embedding's partial lookups matters
        with patched(C._AllReduce, "forward", lambda ctx, x, group: x.clone()):
            broken = _run(layout.tp, False, False)
        if "embedding.output" not in broken:
            report["no all-reduce"] = "went unnoticed"
    assert not report, report
