"""What a training step does with an NF4 base (models/nf4_linear.py), on a model whose attention
projections are dense NF4 linears and whose experts are grouped NF4 linears:
- nothing reads an NF4 layer's `weight` (each read dequantises the whole matrix): not LoRA or
  DoRA while the adapters are built, not the training loop, the grouped experts or the router;
- nothing autograd keeps for backward is the size of a weight: every tensor saved by the forward
  is bounded by the step's widest activation, which is smaller than the smallest NF4 weight;
- the step holds at most about one dequantised expert more than the same step on a bf16 base
  (benchmarks/qlora_memory.py's measurement at a smaller shape)."""

import dataclasses

import pytest
import torch

from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank

pytest.importorskip("bitsandbytes")


def _model(shape, dtype):
    from megatron_lora.models.gpt import build_gpt_model, transformer_config
    from megatron_lora.models.nf4_model import quantize_base
    from megatron_lora.models.specs import local_block_spec

    torch.manual_seed(0)
    config = transformer_config(shape, ParallelLayout(), dtype=dtype)
    model = build_gpt_model(shape, config, block_spec=local_block_spec(
        config, pp_rank=0, moe_grouped_gemm=True))
    quantize_base(model)
    return model


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
@multirank(world_size=1, timeout=300)
def test_no_nf4_weight_is_read_while_adapting_and_training(use_dora, layout=ParallelLayout()):
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.models import nf4_linear as L
    from megatron_lora.models.grouped_experts import GroupedExperts
    from megatron_lora.training.loop import train
    from tests.training import _support as S

    shape = dataclasses.replace(S.SHAPE, hidden_size=128, ffn_hidden_size=128, num_layers=2)
    model = _model(shape, torch.float32)
    assert any(isinstance(m, GroupedExperts) for m in model.modules())
    assert sum(L.is_nf4(m) for m in model.modules()) == 2 * (2 + 2 * shape.num_experts)
    reads = []
    original = L._NF4Weight.__get__

    def counting(self, module, owner=None):
        if module is not None:
            reads.append(type(module).__name__)
        return original(self, module, owner)

    L._NF4Weight.__get__ = counting
    try:
        assert model.decoder.layers[0].self_attention.linear_qkv.weight is not None
        assert reads == ["NF4ColumnParallelLinear"]  # the counter sees a read
        reads.clear()
        apply_lora(model, LoraConfig(r=4, lora_alpha=8, seed=11, lora_dropout=0.1,
                                     use_dora=use_dora,
                                     target_modules=["linear_qkv", "linear_proj",
                                                     "linear_fc1", "linear_fc2"]
                                     + ([] if use_dora else ["router"])),
                   verbose=False)
        result = train([model], S.dataset(samples=8), S.run_config(iters=2), S.optim(2),
                       layout_name="nf4")
    finally:
        L._NF4Weight.__get__ = original
    assert all(torch.isfinite(torch.tensor(v)) for v in result.losses.values())
    assert reads == [], f"{len(reads)} reads of an NF4 weight: {sorted(set(reads))}"


@multirank(world_size=1, timeout=300)
def test_nothing_weight_sized_is_saved_for_backward(layout=ParallelLayout()):
    from megatron_lora.families.shape import tiny_moe_shape
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.models import nf4_linear as L

    shape = tiny_moe_shape(vocab_size=256, hidden_size=256, ffn_hidden_size=256, num_layers=2,
                           num_attention_heads=4, num_query_groups=2, num_experts=4)
    model = _model(shape, torch.bfloat16)
    apply_lora(model, LoraConfig(r=8, lora_alpha=16, seed=1, init_lora_weights=False,
                                 target_modules=["linear_qkv", "linear_proj", "linear_fc1",
                                                 "linear_fc2"]), verbose=False)
    kinds = {type(m).__name__ for m in model.modules() if L.is_nf4(m)}
    assert kinds == {"NF4ColumnParallelLinear", "NF4RowParallelLinear"}
    # The smallest NF4 weight in bf16: linear_proj's [256, 256] (an expert's fc2 is [256, 256]).
    smallest = min(m.nf4_codes.shape[0] * m.nf4_codes.shape[1] * 2 for m in model.modules()
                   if L.is_nf4(m)) * 2
    seq, heads = 16, shape.num_attention_heads
    kv = shape.hidden_size // heads
    qkv = (heads + 2 * shape.num_query_groups) * kv
    # The widest activation of the step, fp32 at most (4 bytes): the routed rows' fc1 output
    # (seq x top-k rows of 2 x ffn), the logits (seq x vocab), the attention scores
    # (heads x seq x seq), the fused qkv projection (seq x qkv).
    widest = 4 * max(seq * shape.moe_router_topk * 2 * shape.ffn_hidden_size,
                     seq * shape.vocab_size, heads * seq * seq, seq * qkv)
    assert widest < smallest, (widest, smallest)  # so a saved weight cannot pass the bound
    own = {t.untyped_storage().data_ptr() for t in list(model.parameters()) +
           list(model.buffers())}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            saved.append((t.untyped_storage().nbytes(), tuple(t.shape), t.dtype))
        return t

    tokens = torch.randint(0, shape.vocab_size, (1, seq),
                           generator=torch.Generator().manual_seed(0))
    positions = torch.arange(seq).expand_as(tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, positions, attention_mask=None, labels=tokens)
    loss.float().sum().backward()
    assert saved, "the forward saved nothing: the hook did not run"
    worst = max(saved)
    assert worst[0] <= widest, (f"saved for backward: {worst[0]} bytes {worst[1]} {worst[2]}, "
                                f"over the widest activation's {widest} (a weight is "
                                f">= {smallest})")
    lora_grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert lora_grads and all(g is not None for g in lora_grads)


@multirank(world_size=1, timeout=300)
def test_qlora_step_holds_at_most_one_dequantised_expert_more_than_lora(
        layout=ParallelLayout()):
    """benchmarks/qlora_memory.py at a smaller shape (hidden 256, 8 experts of ffn 512, vocab
    512, 64 tokens): the QLoRA step's peak of live new bytes exceeds the LoRA step's by at most
    1.25 x the largest grouped expert linear in bf16 (fc1 of all 8 experts, 4 MiB). One expert's
    plain-torch dequantisation holds its fp32 values and product and the bf16 result,
    (4 + 4 + 2) / (8 x 2) = 0.625 x that linear; a stack of all experts' weights alone is 1 x,
    with the dequantised list it was built from 2 x."""
    from benchmarks import qlora_memory as Q
    from megatron_lora.models import grouped_experts

    shape = dict(vocab_size=512, hidden_size=256, ffn_hidden_size=512, num_layers=2,
                 num_attention_heads=4, num_query_groups=2, num_experts=8)
    chunk, grouped_experts.CPU_CHUNK_BYTES = grouped_experts.CPU_CHUNK_BYTES, 0
    try:
        lora, qlora = Q.measure(False, shape, seq=64), Q.measure(True, shape, seq=64)
    finally:
        grouped_experts.CPU_CHUNK_BYTES = chunk
    linear = Q.largest_grouped_linear_bytes(shape)
    extra = qlora["peak"] - lora["peak"]
    assert extra <= Q.TARGET * linear, (
        f"QLoRA step peak {qlora['peak']} at {qlora['op']}, LoRA {lora['peak']} at "
        f"{lora['op']}: extra {extra} > {Q.TARGET} x {linear}")


@multirank(world_size=1, timeout=300)
def test_dora_norm_is_formed_once_per_step_per_linear(layout=ParallelLayout()):
    """Two optimizer steps of 4 microbatches each with DoRA on an NF4 base (grouped experts):
    W + scale B A is formed (dora.squared_row_norms) once per adapter when the magnitudes are
    initialised and once per step after that, not once per microbatch."""
    from megatron_lora.lora import dora as D
    from megatron_lora.lora.adapter import LoraAdapter
    from megatron_lora.lora.expert_lora import ExpertLora
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.training.loop import train
    from tests.training import _support as S

    shape = dataclasses.replace(S.SHAPE, hidden_size=128, ffn_hidden_size=128, num_layers=2)
    model = _model(shape, torch.float32)
    calls = []
    original = D.squared_row_norms

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    D.squared_row_norms = counting
    try:
        apply_lora(model, LoraConfig(r=4, lora_alpha=8, seed=11, lora_dropout=0.1,
                                     use_dora=True, target_modules=["linear_qkv", "linear_proj",
                                                                    "linear_fc1", "linear_fc2"]),
                   verbose=False)
        adapters = sum(isinstance(m, LoraAdapter) for m in model.modules()) + sum(
            m.num_experts for m in model.modules() if isinstance(m, ExpertLora))  # per linear
        assert adapters == 2 * (2 + 2 * shape.num_experts) and len(calls) == adapters
        calls.clear()
        steps = 2
        config = S.run_config(iters=steps)
        assert config.global_batch_size // config.micro_batch_size == 4  # microbatches a step
        train([model], S.dataset(samples=8), config, S.optim(steps), layout_name="nf4")
    finally:
        D.squared_row_norms = original
    # Experts that receive no token in a step form no norm: at most one per adapter per step,
    # at least one per attention adapter (2 layers x qkv, proj) per step.
    assert steps * 4 <= len(calls) <= steps * adapters, (len(calls), steps, adapters)
