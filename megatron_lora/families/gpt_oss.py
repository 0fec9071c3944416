"""GPT-OSS (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b): GQA with an explicit `head_dim`,
biases on q/k/v/o (`attention_bias`), a learned sink logit per head (`self_attn.sinks`), a
sliding window of `sliding_window` keys on the layers `layer_types` marks "sliding_attention",
a router with a bias (`mlp.router`) taking the softmax over the selected top-k logits, and
experts stored fused per layer (`mlp.experts.gate_up_proj` [E, h, 2f] with gate and up
interleaved along the last axis, `down_proj` [E, f, h], both with biases) computing the clamped
SwiGLU: gate clamped above at `swiglu_limit`, up to +-`swiglu_limit`,
gate * sigmoid(`swiglu_alpha` * gate) * (up + 1). In megatron-core: add_bias_linear,
softmax_type="learnable" (`core_attention.softmax_offset`), window_size / window_attn_skip_freq,
activation_func_clamp_value and glu_linear_offset (models/gpt.py); the expert weights may be
MXFP4 (`*_blocks`, `*_scales`), dequantised on conversion (convert/mxfp4.py). RoPE is plain or
YaRN-scaled (`rope_scaling` / `rope_parameters` with `rope_type: "yarn"`, as the published models:
factor 32 over 4096 positions, beta_fast 32, beta_slow 1, truncate false), read by
families/common.py `read_rope` and built as megatron's YaRN embedding (models/gpt.py).

Refused: other scaled RoPE (linear, dynamic, llama3, longrope), YaRN fields transformers would
not read as given (families/common.py `read_yarn`), `attention_bias` false, layer types other
than sliding / full attention, attention dropout, tied embeddings.
"""

from __future__ import annotations

from megatron_lora.families.common import (make_shape, moe_sizes, read_dtype, read_rope,
                                           refuse_true)
from megatron_lora.families import hf_defaults
from megatron_lora.families.family import Family, HFNames
from megatron_lora.families.fields import Fields, ModelConfigError
from megatron_lora.jsonfile import short

LAYER_TYPES = {"sliding_attention": True, "full_attention": False}
# GptOssConfig's RoPE parameters when a config has neither rope_scaling nor rope_parameters
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


def _layer_types(f: Fields, layers: int):
    types = f.get("layer_types", list, default=None, nullable=True)
    if types is None:  # transformers' default: sliding on even layers
        return tuple(i % 2 == 0 for i in range(layers))
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise f.bad("layer_types", f"must list {layers} of {sorted(LAYER_TYPES)} (one per layer, "
                    "num_hidden_layers)", types)
    return tuple(LAYER_TYPES[t] for t in types)


def read(f: Fields, cfg: dict):
    heads = f.integer("num_attention_heads")
    hidden = f.integer("hidden_size")
    vocab = f.integer("vocab_size")
    head_dim = f.integer("head_dim", default=64)
    if not f.get("attention_bias", bool, default=True):
        raise ModelConfigError(f"{f.source}: field attention_bias=false: GPT-OSS is built with "
                               "biases on every linear")
    dropout = f.cfg.get("attention_dropout", 0.0)
    if dropout not in (0, 0.0):
        raise ModelConfigError(f"{f.source}: field attention_dropout={short(dropout)}: only 0")
    max_pos = f.integer("max_position_embeddings", default=131072)
    theta, yarn = read_rope(f, 150000.0, max_pos, scaled=("yarn",), default=DEFAULT_ROPE)
    dtype = read_dtype(f)
    kv_heads = f.integer("num_key_value_heads", default=heads, nullable=True)
    sizes = moe_sizes(f, "intermediate_size", lambda g: g.integer("num_local_experts"), 1e-5,
                      norm_topk_prob=False)
    refuse_true(f, "tie_word_embeddings", why="GPT-OSS has its own lm_head")
    window = f.integer("sliding_window", default=128)
    shape = make_shape(
        f, vocab, hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=heads if kv_heads is None else kv_heads, kv_channels=head_dim,
        max_position_embeddings=max_pos, rotary_base=theta, yarn=yarn, add_bias_linear=True,
        swiglu_alpha=float(f.number("swiglu_alpha", default=1.702)),
        swiglu_limit=float(f.number("swiglu_limit", default=7.0)), attention_sinks=True,
        sliding_window=window, window_layers=_layer_types(f, sizes["num_layers"]), **sizes)
    return shape, vocab, dtype


GPT_OSS = Family(
    name="gpt_oss",
    hf_defaults=hf_defaults.GPT_OSS,
    architectures=("GptOssForCausalLM",),
    model_types=("gpt_oss",),
    read=read,
    # The experts are fused per layer (Family.fused_experts): these names are the layer's
    # `mlp.experts.` tensors, not per-expert modules.
    names=HFNames(router="mlp.router.weight", expert="mlp.experts.",
                  expert_gate="gate_up_proj.weight", expert_up="gate_up_proj.weight",
                  expert_down="down_proj.weight"),
    experts_field="num_local_experts",
    ffn_field="intermediate_size",
    transformers_module="transformers.models.gpt_oss.modeling_gpt_oss",
    fused_experts=True,
    # PEFT (0.21) adapts the router and the fused experts only as target_parameters
    # (`mlp.router.weight`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).
    peft_fused_experts=True,
    refuses=("scaled RoPE other than YaRN (linear, dynamic, llama3, longrope)",
             "YaRN with attention_factor, partial_rotary_factor != 1 or unknown fields",
             "attention_bias false", "layer_types other than sliding_attention / full_attention",
             "attention_dropout > 0", "tie_word_embeddings true"),
)
