"""apply_lora on whole models: targets, freezing, layout-independent adapters, bad configs."""

import pytest
import torch
import torch.distributed as dist

from megatron_lora.lora import global_factors
from megatron_lora.lora.model import (
    LoraConfig,
    apply_lora,
    count_parameters,
    get_adapter_params,
    merge_adapters,
    unmerge_adapters,
)
from megatron_lora.lora.targets import UnknownTargetError, normalize_targets
from megatron_lora.models.gpt import build_gpt_model, tiny_moe_shape, transformer_config
from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing import compare
from tests.harness import multirank

DENSE = tiny_moe_shape(num_experts=None)


def test_targets_accept_megatron_hf_and_all_linear_names():
    assert normalize_targets(["q_proj", "v_proj", "o_proj"]) == ("linear_qkv", "linear_proj")
    assert normalize_targets("all-linear") == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert normalize_targets(["w1", "w3", "w2", "gate", "lm_head", "embed_tokens"]) == (
        "linear_fc1", "linear_fc2", "router", "embedding", "output_layer")
    with pytest.raises(UnknownTargetError, match="unknown LoRA target 'qproj'; accepted: linear_qkv"):
        normalize_targets(["qproj"])


@pytest.mark.parametrize("kwargs,message", [
    (dict(r=0), "LoraConfig.r must be a positive integer"),
    (dict(lora_alpha=-1.0), "LoraConfig.lora_alpha must be"),
    (dict(lora_dropout=1.0), "LoraConfig.lora_dropout must be in"),
    (dict(rank_pattern={"experts": -2}), "LoraConfig.r must be a positive integer"),
    (dict(rank_pattern={"(": 2}), "not a valid regular expression"),
])
def test_bad_configs_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        LoraConfig(**kwargs)


def test_rank_and_alpha_patterns_override_by_global_name():
    config = LoraConfig(r=8, lora_alpha=16, rank_pattern={r"experts\.\d+\.linear_fc1": 4},
                        alpha_pattern={"self_attention": 32})
    assert config.adapter_config("decoder.layers.1.mlp.experts.3.linear_fc1").rank == 4
    assert config.adapter_config("decoder.layers.1.mlp.experts.3.linear_fc2").rank == 8
    assert config.adapter_config("decoder.layers.0.self_attention.linear_qkv").alpha == 32


def _global_factors(adapters):
    """{name: (A, B)} gathered to global shapes over each adapter's group."""
    return {name: global_factors(ad) for name, ad in adapters.items()}


@multirank(world_size=2)
def test_the_same_config_gives_the_same_global_adapters_at_any_layout():
    from megatron_lora import runtime

    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, seed=3)
    results = {}
    for layout in (ParallelLayout(), ParallelLayout(tp=2, sp=True), ParallelLayout(pp=2)):
        runtime.initialize(layout)
        model = build_gpt_model(DENSE, transformer_config(DENSE, layout))
        adapters = apply_lora(model, config, verbose=False)
        results[layout.describe()] = _global_factors(adapters)
        runtime.destroy()
    single = results["TP1"]
    assert len(single) == 4 * DENSE.num_layers
    for layout_name in ("TP2+SP", "PP2"):
        for name, (a, b) in results[layout_name].items():
            torch.testing.assert_close(a, single[name][0], rtol=0, atol=0)
            torch.testing.assert_close(b, single[name][1], rtol=0, atol=0)
    # Different modules start from different factors.
    names = sorted(single)
    assert not torch.equal(single[names[0]][0], single[names[1]][0])


@multirank(world_size=1, timeout=300)
def test_expert_adapters_are_four_tensors_per_moe_layer_at_any_expert_count(
        layout=ParallelLayout()):
    """Expert LoRA is one stacked A and B per expert linear per MoE layer ([E, r, in] and
    [E, out, r]): the number of trainable tensors does not grow with the expert count, and the
    parameter count is the per-expert sum (r (in + out) per expert linear)."""
    from megatron_lora.lora.expert_lora import ExpertLora

    counts = {}
    for experts in (4, 16):
        shape = tiny_moe_shape(num_experts=experts)
        model = build_gpt_model(shape, transformer_config(shape, layout))
        adapters = apply_lora(model, LoraConfig(r=4, target_modules=["linear_fc1", "linear_fc2"]),
                              verbose=False)
        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
        per_layer = {}
        for name in trainable:
            layer = name.split(".mlp.")[0]
            per_layer[layer] = per_layer.get(layer, 0) + 1
        assert set(per_layer.values()) == {4}, per_layer  # fc1 A, B and fc2 A, B
        assert all(isinstance(a, ExpertLora) for a in adapters.values())
        fc1 = trainable["decoder.layers.0.mlp.experts.adapters.linear_fc1.lora_A"]
        h, f = shape.hidden_size, shape.ffn_hidden_size  # the experts' ffn size
        assert tuple(fc1.shape) == (experts, 4, h)
        count, _ = count_parameters(model)
        assert count == shape.num_layers * experts * 4 * ((h + 2 * f) + (f + h))
        counts[experts] = len(trainable)
    assert counts[4] == counts[16], counts


@multirank(world_size=2)
def test_everything_but_the_adapters_is_frozen_and_counted_once(layout=ParallelLayout(tp=2, sp=True)):
    model = build_gpt_model(DENSE, transformer_config(DENSE, layout))
    _, total_before = count_parameters(model)
    apply_lora(model, LoraConfig(r=4, target_modules=["q_proj", "o_proj"]), verbose=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(get_adapter_params(model))
    assert all("self_attention" in n for n in trainable)
    count, total = count_parameters(model)
    h, layers = DENSE.hidden_size, DENSE.num_layers
    qkv_out = (DENSE.num_attention_heads + 2 * DENSE.num_query_groups) * (h // DENSE.num_attention_heads)
    expected = layers * 4 * ((h + qkv_out) + (h + h))  # A [r, in] + B [out, r], r=4
    assert count == expected
    assert total == total_before + expected


@multirank(world_size=2)
def test_unknown_or_oversized_targets_fail_on_every_rank_before_any_change(layout=ParallelLayout(pp=2)):
    model = build_gpt_model(DENSE, transformer_config(DENSE, layout))
    before = [p.requires_grad for p in model.parameters()]
    with pytest.raises(UnknownTargetError, match=r"\['router'\] do not exist in this model; its targets"):
        apply_lora(model, LoraConfig(target_modules=["gate", "q_proj"]))
    with pytest.raises(ValueError, match="LoRA rank 512 .* exceeds min\\(in_features, out_features\\) = 64 of linear_proj"):
        apply_lora(model, LoraConfig(r=4, rank_pattern={"proj": 512}))
    with pytest.raises(ValueError, match="rank_pattern gives the linear_qkv adapters different ranks \\[2, 4\\]"):
        apply_lora(model, LoraConfig(r=4, rank_pattern={r"layers\.1\.": 2}))
    assert [p.requires_grad for p in model.parameters()] == before
    dist.barrier()  # every rank got here: nobody is stuck in a collective


def _logits_and_bound(model, tokens, pos):
    """The model's fp32 logits and compare.reference_bound of them: the same model (adapters
    unmerged) run again in fp64 on the same tokens, then back to fp32 (exact: fp32 values).
    The merged model computes x (W + s B A)^T where the adapter computes x W^T + s (x A^T) B^T:
    the same real function in another fp32 order, so its logits lie within the bound; after
    unmerge the weights are (W + D) - D, within 2 u (|W| + |D|) of W (D the same tensor both
    times), a perturbation of the size of a product's own rounding, which K covers."""
    logits = model(tokens, pos, attention_mask=None)
    model.double()
    logits64 = model(tokens, pos, attention_mask=None)
    model.float()
    assert logits64.dtype == torch.float64
    return logits, compare.reference_bound(logits, logits64)


@multirank(world_size=2)
def test_merge_and_unmerge_the_whole_model(layout=ParallelLayout(tp=2, sp=True)):
    model = build_gpt_model(DENSE, transformer_config(DENSE, layout))
    apply_lora(model, LoraConfig(r=4, init_lora_weights=False), verbose=False)
    tokens = torch.randint(0, DENSE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        with_lora, bound = _logits_and_bound(model, tokens, pos)
        merge_adapters(model)
        merged = model(tokens, pos, attention_mask=None)
        unmerge_adapters(model)
        again = model(tokens, pos, attention_mask=None)
    compare.assert_within(merged, with_lora, bound, "merged logits")
    compare.assert_within(again, with_lora, bound, "unmerged logits")


@multirank(world_size=2)
def test_merge_and_unmerge_router_embedding_and_output_adapters(layout=ParallelLayout(tp=2, sp=True)):
    shape = tiny_moe_shape()
    model = build_gpt_model(shape, transformer_config(shape, layout))
    apply_lora(model, LoraConfig(r=4, init_lora_weights=False,
                                 target_modules=["router", "embedding", "output_layer"]),
               verbose=False)
    tokens = torch.randint(0, shape.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        with_lora, bound = _logits_and_bound(model, tokens, pos)
        embedding = model.embedding.word_embeddings
        base_weight = embedding.base_layer.weight.clone()
        delta = embedding.delta_weight()
        merge_adapters(model)
        merged = model(tokens, pos, attention_mask=None)
        unmerge_adapters(model)
        again = model(tokens, pos, attention_mask=None)
        unchanged = embedding.base_layer.weight
    compare.assert_within(merged, with_lora, bound, "merged logits")
    compare.assert_within(again, with_lora, bound, "unmerged logits")
    # fl(fl(W + D) - D) with the same D both times: within u |W + D| + u |W + D - D + ...|
    # <= 2 u (|W| + |D|) of W per element (u = 2**-24)
    u = compare.unit_roundoff(torch.float32)
    compare.assert_within(unchanged, base_weight,
                          2 * u * (base_weight.double().abs() + delta.double().abs()),
                          "embedding weight after merge and unmerge")


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
@multirank(world_size=2, timeout=300)
def test_apply_lora_wires_expert_dropout_through_the_dispatcher(dispatcher,
                                                                layout=ParallelLayout(ep=2)):
    """With lora_dropout on the experts, apply_lora attaches each MoE layer's token route: in a
    training step every expert adapter on every rank masks by global token indices that came
    through the dispatcher (each position of the replica's [s, b] reaching its top-k experts);
    in eval nothing is routed."""
    shape = tiny_moe_shape()
    model = build_gpt_model(shape, transformer_config(shape, layout, dispatcher=dispatcher))
    adapters = apply_lora(model, LoraConfig(r=4, lora_dropout=0.25, init_lora_weights=False,
                                            target_modules=["linear_fc1", "linear_fc2"]),
                          verbose=False)
    from megatron_lora.lora.experts import ExpertLora, ExpertSlot

    assert all(isinstance(a, ExpertLora) for n, a in adapters.items() if ".experts." in n)
    experts = [m for m in model.modules() if isinstance(m, ExpertSlot)]  # each expert's linear
    seen = {}
    for adapter in experts:
        def spy(input_, _source=adapter.dropout_rows, _name=adapter.global_name):
            key, rows = _source(input_)
            seen.setdefault(_name, []).append(rows)
            return key, rows
        adapter.dropout_rows = spy
    seq, batch = 16, 2
    tokens = torch.randint(0, shape.vocab_size, (batch, seq),
                           generator=torch.Generator().manual_seed(0))
    pos = torch.arange(seq).unsqueeze(0)
    model.train()
    model(tokens, pos, attention_mask=None).float().sum().backward()
    assert sorted(seen) == sorted(a.global_name for a in experts)
    layers = sorted({n.split(".mlp.")[0] for n in seen})
    for name, calls in seen.items():
        assert len(calls) == 1, name  # one call per training forward
    for layer in layers:
        # Over both ranks' fc1 adapters of a layer, each token position of [s, b] arrives
        # exactly top-k times per replica (the two EP ranks are the two data-parallel replicas).
        counts = torch.zeros(seq * batch, dtype=torch.int64)
        for name, calls in seen.items():
            if name.startswith(layer + ".") and name.endswith("linear_fc1"):
                counts += torch.bincount(calls[0], minlength=seq * batch)[: seq * batch]
                assert calls[0].numel() == 0 or calls[0].max() < seq * batch, name
        dist.all_reduce(counts)
        assert torch.all(counts == 2 * shape.moe_router_topk), (layer, counts)
    held = torch.tensor([len(experts)])
    dist.all_reduce(held)
    assert held.item() == 2 * len(layers) * shape.num_experts  # fc1 + fc2 of all global experts
    seen.clear()
    model.eval()
    with torch.no_grad():
        model(tokens, pos, attention_mask=None)
    assert not seen
