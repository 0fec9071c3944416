"""tools/memory_estimate.py reads any supported family's config.json: its weights count equals
the published parameter totals (Mixtral 8x7B: 46.7B; Qwen3-30B-A3B: 30.5B; Qwen3-235B-A22B:
235B; GLM-4.5-Air: 106B, its dense first layer counted with its own MLP; gpt-oss-20b: 20.91B;
gpt-oss-120b: 116.83B, with their biases and sinks; DeepSeek-V3: 671.0B without its
multi-token-prediction layer) at one GPU, shrinks as the layout shards it, and counts a shared
expert; multi-latent attention is counted tensor for tensor as transformers builds it (a tiny
DeepSeek-V3 made from its config class), split over TP as models/mla.py splits it; the tables of
examples/glm4_moe/README.md and the NF4 tables of examples/mixtral_8x7b and examples/qwen3_moe
are the output of the commands shown above them (examples/deepseek_v3/README.md's run in
tests/docs/test_docs_run.py)."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _estimate():
    spec = importlib.util.spec_from_file_location(
        "memory_estimate", os.path.join(ROOT, "tools", "memory_estimate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.estimate


def _config(name):
    return json.load(open(os.path.join(ROOT, "examples", name)))


@pytest.mark.parametrize("config,billions", [("mixtral_8x7b/config.json", 46.7),
                                             ("qwen3_moe/config_30b_a3b.json", 30.5),
                                             ("qwen3_moe/config_235b_a22b.json", 235.1),
                                             ("glm4_moe/config.json", 106.0),
                                             ("gpt_oss/config_20b.json", 20.91),
                                             ("gpt_oss/config_120b.json", 116.83),
                                             ("deepseek_v3/config.json", 671.0)])
def test_weights_at_one_gpu_are_the_published_parameter_count(config, billions):
    e = _estimate()(_config(config), ParallelLayout(), 1, 4096, 1, 16)
    # the published figures' own rounding: GPT-OSS's (20.91B, 116.83B) and DeepSeek-V3's (671.0B)
    # to 4 significant digits, within 5e-4 relative (counted here: 2.3e-4, 7e-6, 3.9e-5); the
    # others are given to 3 digits (46.7B, 30.5B: within 0.05 / 30.5 = 1.6e-3) or as a whole
    # 106B (GLM-4.5-Air, 106.85B counted: 0.8%), so within 1%
    rel = 1e-3 if config.startswith(("gpt_oss", "deepseek")) else 0.01
    assert e["weights"] / 2 / 1e9 == pytest.approx(billions, rel=rel)  # bf16: 2 bytes each
    sharded = _estimate()(_config(config), ParallelLayout(tp=2, ep=4, sp=True), 8, 4096, 1, 16)
    assert sharded["weights"] < e["weights"] / 4 and sharded["activations"] < e["activations"]


def test_a_shared_expert_adds_its_weights_and_adapters():
    # Qwen3's sizes with head_dim = hidden / heads (what Qwen2-MoE has), without and with a
    # shared expert of 2048
    base = dict(_config("qwen3_moe/config_30b_a3b.json"), head_dim=64)
    qwen2 = dict(base, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
                 shared_expert_intermediate_size=2048, qkv_bias=False)
    qwen2.pop("head_dim")
    plain = _estimate()(qwen2, ParallelLayout(), 1, 4096, 1, 16)
    ref = _estimate()(base, ParallelLayout(), 1, 4096, 1, 16)
    h, fs, layers = 2048, 2048, 48
    assert plain["weights"] - ref["weights"] == pytest.approx(2 * layers * (3 * h * fs + h))
    assert plain["adapters"] - ref["adapters"] == pytest.approx(
        2 * layers * 16 * ((h + 2 * fs) + (fs + h)))


def test_nf4_base_holds_the_decoder_linears_at_half_a_byte():
    # Mixtral 8x7B: per layer q, k, v, o (h (n + 2 g) d + n d h) and 8 experts x 3 h f
    h, n, g, d, f, layers, experts = 4096, 32, 8, 128, 14336, 32, 8
    linears = layers * (h * (n + 2 * g) * d + n * d * h + experts * 3 * h * f)
    nf4_bytes = 0.5 + 1 / 64 + 4 / 16384  # codes, uint8 block scales, fp32 per 256 scales
    for layout in (ParallelLayout(), ParallelLayout(tp=2, ep=4, sp=True)):
        bf16 = _estimate()(_config("mixtral_8x7b/config.json"), layout, 8, 4096, 1, 16)
        nf4 = _estimate()(_config("mixtral_8x7b/config.json"), layout, 8, 4096, 1, 16,
                          base_quantization="nf4")
        if layout.tp == 1 and layout.ep == 1:  # one GPU: every linear parameter 2 -> 0.516 B
            assert bf16["weights"] - nf4["weights"] == pytest.approx(
                linears * (2 - nf4_bytes), rel=1e-9)
        assert nf4["weights"] < bf16["weights"] * 0.3  # the bf16 embeddings are the rest
        assert {k: v for k, v in nf4.items() if k != "weights"} == \
            {k: v for k, v in bf16.items() if k != "weights"}


@pytest.mark.parametrize("example,count", [("glm4_moe", 3), ("mixtral_8x7b", 1),
                                           ("qwen3_moe", 3)])
def test_the_readme_tables_are_the_output_of_its_commands(example, count):
    """The ```sh estimator commands of examples/<example>/README.md (GLM-4.5-Air on one node in
    bf16 and NF4; the NF4 tables of Mixtral 8x7B and Qwen3-235B-A22B on 8 H200) print rows the
    README shows."""
    readme = open(os.path.join(ROOT, "examples", example, "README.md")).read()
    commands = re.findall(r"```sh\n(python tools/memory_estimate.py [^\n]*)\n```", readme)
    assert len(commands) == count, commands
    for command in commands:
        out = subprocess.run([sys.executable, *command.split()[1:]], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
        rows = [line for line in out.splitlines() if line.startswith("| ")]
        assert len(rows) >= 2 and all(row in readme for row in rows), (command, out)


def test_a_dense_first_layer_is_counted_with_its_own_mlp():
    # GLM-4.5-Air with layer 0 dense against every layer MoE: one layer's experts, router and
    # shared expert fewer, one dense MLP of intermediate_size more
    air = _config("glm4_moe/config.json")
    h, f, F, E = 4096, 1408, 10944, 128
    dense = _estimate()(air, ParallelLayout(), 1, 4096, 1, 16)
    moe = _estimate()(dict(air, first_k_dense_replace=0), ParallelLayout(), 1, 4096, 1, 16)
    assert moe["weights"] - dense["weights"] == pytest.approx(
        2 * (E * 3 * h * f + E * h + 3 * h * f - 3 * h * F))
    r = 16
    assert moe["adapters"] - dense["adapters"] == pytest.approx(
        2 * ((E + 1) * r * (2 * h + 3 * f) - r * (2 * h + 3 * F)))


TINY_DEEPSEEK = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                     n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16, q_lora_rank=24,
                     qk_rope_head_dim=4, v_head_dim=10, qk_nope_head_dim=8, n_group=2, topk_group=1,
                     num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
                     tie_word_embeddings=False)


def _tiny_deepseek(**overrides):
    """(config.json dict, {tensor name: numel}) of a tiny DeepSeek-V3 that transformers builds
    from its config class (parameters and the routers' e_score_correction_bias buffers)."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(**dict(TINY_DEEPSEEK, **overrides))
    model = AutoModelForCausalLM.from_config(config)
    tensors = {n: p.numel() for n, p in model.named_parameters()}
    tensors.update({n: b.numel() for n, b in model.named_buffers()
                    if n.endswith("e_score_correction_bias")})
    return config.to_dict(), tensors


@pytest.fixture(scope="module", params=[24, None], ids=["q_lora_rank", "q_proj"])
def tiny_deepseek(request):
    return _tiny_deepseek(q_lora_rank=request.param)


def test_deepseek_weights_are_transformers_tensors(tiny_deepseek):
    """Every tensor transformers' DeepseekV3ForCausalLM holds, bf16 (the expert bias fp32), at one
    GPU; at TP2+SP each is halved but the q/kv latent norms and the expert bias, which every TP
    rank holds whole (models/mla.py; the routers and layer norms are halved, as for every
    family)."""
    cfg, tensors = tiny_deepseek
    bias = sum(n for name, n in tensors.items() if name.endswith("e_score_correction_bias"))
    whole = sum(n for name, n in tensors.items()
                if name.endswith(("q_a_layernorm.weight", "kv_a_layernorm.weight")))
    assert whole == 3 * (16 + (24 if cfg["q_lora_rank"] else 0))  # the names are transformers'
    bf16 = sum(tensors.values()) - bias
    one = _estimate()(cfg, ParallelLayout(), 1, 64, 1, 16)
    assert one["weights"] == 2 * bf16 + 4 * bias
    tp2 = _estimate()(cfg, ParallelLayout(tp=2, sp=True), 2, 64, 1, 16)
    assert tp2["weights"] == 2 * (bf16 - whole) / 2 + 2 * whole + 4 * bias


def test_deepseek_nf4_holds_every_decoder_linear(tiny_deepseek):
    """--base-quantization nf4: every matrix of the decoder layers (the MLA projections, the
    dense MLP, the experts and the shared expert) at NF4's bytes, the routers in bf16."""
    cfg, tensors = tiny_deepseek
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    model = AutoModelForCausalLM.from_config(DeepseekV3Config(**dict(
        TINY_DEEPSEEK, q_lora_rank=cfg["q_lora_rank"])))
    linears = sum(p.numel() for n, p in model.model.layers.named_parameters()
                  if p.dim() >= 2 and not n.endswith("mlp.gate.weight"))
    nf4_bytes = 0.5 + 1 / 64 + 4 / 16384
    bf16 = _estimate()(cfg, ParallelLayout(), 1, 64, 1, 16)
    nf4 = _estimate()(cfg, ParallelLayout(), 1, 64, 1, 16, base_quantization="nf4")
    assert bf16["weights"] - nf4["weights"] == pytest.approx(linears * (2 - nf4_bytes), rel=1e-12)


def test_deepseek_mla_activations_and_adapters_by_hand():
    """One token of one MLA layer keeps (h 64, 4 heads, q_lora_rank 24, kv_lora_rank 16, rope 4,
    nope 8, v 10; q/k heads of 12, v padded to 12): the layer's input, the attention's input and
    the pre-MLP norm's input 3 x 64, the q latent and its norm's output 2 x 24 and the norm's
    fp32 copy 2 x 24, the same for the kv latent 4 x 16, q, k, v and the kernel's output
    4 x 4 x 12, linear_proj's input 4 x 10 = 584 elements; the MLP's tokens as for every family
    (1 dense layer of 96, 2 MoE layers of top-2 of 32 and a shared expert of 32). `linear_qkv`
    adapts the four q/kv projections, `linear_proj` the output."""
    cfg, _ = _tiny_deepseek()
    h, s, r = 64, 64, 16
    moe_width = 2 * 2 * (1 + 3 * 32 / h) + (1 + 3 * 32 / h)
    dense_width = 1 + 3 * 96 / h
    e = _estimate()(cfg, ParallelLayout(), 1, s, 1, r)
    assert e["activations"] == pytest.approx(
        2 * s * (2 * (584 + h * moe_width) + (584 + h * dense_width)), rel=1e-12)
    attention = r * ((24 + 64) + (48 + 24) + (20 + 64) + (72 + 16)) + r * (40 + 64)
    only_attention = _estimate()(cfg, ParallelLayout(), 1, s, 1, r,
                                 targets=("linear_qkv", "linear_proj"))
    assert only_attention["adapters"] == 2 * 3 * attention
    tp2 = _estimate()(cfg, ParallelLayout(tp=2, sp=True), 2, s, 1, r)
    assert tp2["activations"] == pytest.approx(e["activations"] / 2, rel=1e-12)
    with pytest.raises(ValueError, match="--unfused-attention: multi-latent attention"):
        _estimate()(cfg, ParallelLayout(), 1, s, 1, r, unfused_attention=True)


def test_deepseek_v3_bf16_needs_two_nodes_of_h200():
    """examples/deepseek_v3/README.md's claim: no 8-GPU layout holds bf16 LoRA of DeepSeek-V3 in
    an H200's 141 GB even with full recomputation; 16 GPUs (2 nodes) do."""
    cfg = _config("deepseek_v3/config.json")
    h200 = 141e9

    def best(world, layouts):
        return min(sum(_estimate()(cfg, ParallelLayout.parse(name), world, 4096, 1, 16,
                                   recompute="full").values()) for name in layouts)

    one_node = ["TP1xEP8", "TP2xEP4+SP", "TP4xEP2+SP", "TP8xEP1+SP", "TP2xEP8xETP1+SP",
                "TP4xEP8xETP1+SP", "TP8xEP8xETP1+SP"]
    assert best(8, one_node) > h200
    assert best(16, ["TP8xEP16xETP1+SP"]) < 0.7 * h200


@multirank(world_size=1, timeout=300)
def test_mla_activations_are_what_autograd_keeps(layout=ParallelLayout()):
    """The estimate's MLA attention part is what megatron's MLA layer (models/mla.py, bf16, CPU)
    saves for backward, measured with saved-tensor hooks (each storage once, parameters not
    counted), up to the terms left out: the kernel's logsumexp (n fp32 per token), the two
    latent norms' rms (fp32), the rope's cos and sin (rope bf16 per position, saved twice each)."""
    import torch
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_lora.families import model_info
    from megatron_lora.models.mla import mla_attention_spec, mla_config_kwargs

    spec = importlib.util.spec_from_file_location(
        "memory_estimate", os.path.join(ROOT, "tools", "memory_estimate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for q_lora_rank in (24, None):
        cfg = dict(_tiny_deepseek(q_lora_rank=q_lora_rank)[0])
        shape = model_info(cfg).shape
        config = MLATransformerConfig(
            num_layers=1, hidden_size=64, num_attention_heads=4, params_dtype=torch.bfloat16,
            bf16=True, use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
            **mla_config_kwargs(shape))
        attention = build_module(mla_attention_spec(), config=config, layer_number=1)
        weights = {p.untyped_storage().data_ptr() for p in attention.parameters()}
        s, b, n, rope = 32, 2, 4, 4
        kept = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(s, b, 64, dtype=torch.bfloat16, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            attention(x, None)[0].sum().backward()
        left_out = 4 * n + 4 * (2 if q_lora_rank else 1) + 2 * 2 * rope * 2 / b
        measured = sum(kept.values()) / (s * b)
        estimated = 2 * module.mla_attention_kept(shape) + left_out
        assert measured == estimated, (q_lora_rank, measured, estimated)


@pytest.mark.parametrize("name,world", [("TP8xEP16xETP1+SP", 16), ("TP8xEP8xETP1+SP", 8),
                                        ("TP2xEP4+SP", 8)])
def test_deepseek_v3_weights_per_gpu_agree_with_the_rank_count(name, world):
    """At the README's layouts the estimate's weights are within 0.5% of
    convert/checks.py's bytes per rank (which the family tests compare with what a built model
    allocates): the estimate divides routers and layer norms over TP, which every TP rank holds
    whole (0.22% at TP8xEP16xETP1+SP)."""
    import torch

    from megatron_lora.convert.checks import parameter_bytes_per_rank
    from megatron_lora.families import model_info

    cfg = _config("deepseek_v3/config.json")
    layout = ParallelLayout.parse(name)
    exact = parameter_bytes_per_rank(model_info(cfg), layout, torch.bfloat16)
    assert _estimate()(cfg, layout, world, 4096, 1, 16)["weights"] == pytest.approx(exact,
                                                                                    rel=5e-3)
