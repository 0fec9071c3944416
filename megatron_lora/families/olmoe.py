"""OLMoE (OlmoeForCausalLM: allenai/OLMoE-1B-7B): Llama attention (GQA, RoPE) with an RMSNorm over
the whole query projection ([n*d] weight) and the whole key projection ([g*d]) before RoPE - not
per head as Qwen3's (ModelShape.qk_norm_full_width, built by models/qk_norm.py) - softmax routing
over `num_experts` experts with `norm_topk_prob` choosing renormalised (true) or plain (false,
the default) top-k weights, SwiGLU experts `mlp.experts.{e}.gate_proj/up_proj/down_proj`, router
`mlp.gate`, no biases.

Refused: other activations, `clip_qkv` (clamping q/k/v, which megatron-core does not do),
`attention_bias`, scaled RoPE, an effective sliding window, and head_dim other than
hidden_size / num_attention_heads (transformers sizes the norms from hidden_size).
"""

from __future__ import annotations

from megatron_lora.families.common import (make_shape, moe_sizes, num_experts, read_activation,
                                           read_dtype, read_rope_theta, refuse_sliding_window,
                                           refuse_true)
from megatron_lora.families import hf_defaults
from megatron_lora.families.family import Family, HFNames
from megatron_lora.families.fields import Fields, ModelConfigError
from megatron_lora.jsonfile import short


def read(f: Fields, cfg: dict):
    heads = f.integer("num_attention_heads")
    hidden = f.integer("hidden_size")
    vocab = f.integer("vocab_size")
    read_activation(f)
    head_dim = f.integer("head_dim", default=None, nullable=True)
    if head_dim is not None and head_dim * heads != hidden:
        raise ModelConfigError(
            f"{f.source}: field head_dim={head_dim} differs from hidden_size/"
            f"num_attention_heads={hidden}/{heads}; OLMoE's query and key norms are sized from "
            f"hidden_size, so only head_dim = hidden_size/num_attention_heads is supported"
        )
    clip = f.cfg.get("clip_qkv")
    if clip is not None:
        raise ModelConfigError(f"{f.source}: field clip_qkv={short(clip)}: clamping the query, "
                               f"key and value is not supported (use null)")
    refuse_true(f, "attention_bias", why="attention biases (q/k/v and o_proj) are not supported")
    theta = read_rope_theta(f, default=10000.0)
    max_pos = f.integer("max_position_embeddings", default=4096)
    refuse_sliding_window(f, max_pos)
    dtype = read_dtype(f)
    kv_heads = f.integer("num_key_value_heads", default=heads, nullable=True)
    sizes = moe_sizes(f, "intermediate_size", num_experts, 1e-5, norm_topk_prob=True)
    shape = make_shape(f, vocab, hidden_size=hidden, num_attention_heads=heads,
                       num_query_groups=heads if kv_heads is None else kv_heads,
                       max_position_embeddings=max_pos, rotary_base=theta,
                       qk_layernorm=True, qk_norm_full_width=True, **sizes)
    return shape, vocab, dtype


OLMOE = Family(
    name="olmoe",
    hf_defaults=hf_defaults.OLMOE,
    architectures=("OlmoeForCausalLM",),
    model_types=("olmoe",),
    read=read,
    names=HFNames(router="mlp.gate.weight", expert="mlp.experts.{e}.",
                  expert_gate="gate_proj.weight", expert_up="up_proj.weight",
                  expert_down="down_proj.weight"),
    experts_field="num_experts",
    ffn_field="intermediate_size",
    transformers_module="transformers.models.olmoe.modeling_olmoe",
    refuses=("hidden_act other than silu", "clip_qkv not null", "attention_bias true",
             "scaled RoPE", "sliding_window smaller than max_position_embeddings",
             "head_dim other than hidden_size / num_attention_heads"),
)
