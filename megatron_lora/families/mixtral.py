"""Mixtral (MixtralForCausalLM): Llama attention (GQA, RoPE, RMSNorm), top-k softmax routing with
renormalised weights, SwiGLU experts `block_sparse_moe.experts.{e}.w1/w3/w2`, no biases.

Refused: other activations, biases, scaled RoPE, an effective sliding window, head_dim other than
hidden_size / num_attention_heads.
"""

from __future__ import annotations

from megatron_lora.families.common import (make_shape, moe_sizes, read_activation, read_dtype,
                                           read_rope_theta, refuse_sliding_window, refuse_true)
from megatron_lora.families import hf_defaults
from megatron_lora.families.family import Family, HFNames
from megatron_lora.families.fields import Fields, ModelConfigError


def read(f: Fields, cfg: dict):
    heads = f.integer("num_attention_heads")
    hidden = f.integer("hidden_size")
    vocab = f.integer("vocab_size")
    read_activation(f)
    head_dim = f.integer("head_dim", default=None, nullable=True)
    if head_dim is not None and head_dim * heads != hidden:
        raise ModelConfigError(
            f"{f.source}: field head_dim={head_dim} differs from hidden_size/"
            f"num_attention_heads={hidden}/{heads}; megatron_lora supports head_dim = "
            f"hidden_size/num_attention_heads for Mixtral"
        )
    refuse_true(f, "attention_bias", "mlp_bias")
    theta = read_rope_theta(f)
    max_pos = f.integer("max_position_embeddings", default=131072)
    refuse_sliding_window(f, max_pos)
    dtype = read_dtype(f)
    kv_heads = f.integer("num_key_value_heads", default=heads, nullable=True)
    sizes = moe_sizes(f, "intermediate_size", lambda f: f.integer("num_local_experts"), 1e-5,
                      norm_topk_prob=False)
    shape = make_shape(f, vocab, hidden_size=hidden, num_attention_heads=heads,
                       num_query_groups=heads if kv_heads is None else kv_heads,
                       max_position_embeddings=max_pos, rotary_base=theta, **sizes)
    return shape, vocab, dtype


MIXTRAL = Family(
    name="mixtral",
    hf_defaults=hf_defaults.MIXTRAL,
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    read=read,
    names=HFNames(router="block_sparse_moe.gate.weight", expert="block_sparse_moe.experts.{e}.",
                  expert_gate="w1.weight", expert_up="w3.weight", expert_down="w2.weight"),
    experts_field="num_local_experts",
    ffn_field="intermediate_size",
    transformers_module="transformers.models.mixtral.modeling_mixtral",
    module_aliases=((".mlp.", ".block_sparse_moe."),),
    refuses=("hidden_act other than silu", "attention_bias / mlp_bias true", "scaled RoPE",
             "sliding_window smaller than max_position_embeddings",
             "head_dim other than hidden_size / num_attention_heads"),
)
