"""Qwen3-MoE (Qwen3MoeForCausalLM: Qwen3-30B-A3B, Qwen3-235B-A22B): GQA with an explicit
`head_dim` (q may be wider than the hidden size), an RMSNorm over each query and key head before
RoPE, softmax routing over `num_experts` experts with `norm_topk_prob` choosing renormalised
(true) or plain (false) top-k weights, SwiGLU experts `mlp.experts.{e}.gate_proj/up_proj/
down_proj`, router `mlp.gate`, no biases.

Refused: other activations, `attention_bias` (it biases o_proj too, which megatron's qkv bias does
not), scaled RoPE, an effective sliding window (`use_sliding_window`), and a model with no MoE
layer left. Dense layers between the MoE layers (`mlp_only_layers`, `decoder_sparse_step` > 1)
are SwiGLU MLPs of `intermediate_size` (`mlp.gate_proj/up_proj/down_proj`).
"""

from __future__ import annotations

from megatron_lora.families.common import (dense_layers, make_shape, moe_sizes, num_experts,
                                           qwen_moe_layers, read_activation, read_dtype,
                                           read_rope_theta, refuse_sliding_window, refuse_true)
from megatron_lora.families import hf_defaults
from megatron_lora.families.family import Family, HFNames
from megatron_lora.families.fields import Fields


def read(f: Fields, cfg: dict):
    heads = f.integer("num_attention_heads")
    hidden = f.integer("hidden_size")
    vocab = f.integer("vocab_size")
    read_activation(f)
    head_dim = f.integer("head_dim", default=None, nullable=True)
    refuse_true(f, "attention_bias", why="attention biases (q/k/v and o_proj) are not supported")
    theta = read_rope_theta(f, default=10000.0)
    max_pos = f.integer("max_position_embeddings", default=32768)
    refuse_sliding_window(f, max_pos, use_field="use_sliding_window")
    dtype = read_dtype(f)
    kv_heads = f.integer("num_key_value_heads", default=heads, nullable=True)
    sizes = moe_sizes(f, "moe_intermediate_size", num_experts, 1e-6, norm_topk_prob=True)
    sizes.update(dense_layers(f, qwen_moe_layers(f, sizes["num_layers"])))
    shape = make_shape(f, vocab, hidden_size=hidden, num_attention_heads=heads,
                       num_query_groups=heads if kv_heads is None else kv_heads,
                       max_position_embeddings=max_pos, rotary_base=theta,
                       kv_channels=head_dim, qk_layernorm=True, **sizes)
    return shape, vocab, dtype


QWEN3_MOE = Family(
    name="qwen3_moe",
    hf_defaults=hf_defaults.QWEN3_MOE,
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    read=read,
    names=HFNames(router="mlp.gate.weight", expert="mlp.experts.{e}.",
                  expert_gate="gate_proj.weight", expert_up="up_proj.weight",
                  expert_down="down_proj.weight"),
    experts_field="num_experts",
    ffn_field="moe_intermediate_size",
    transformers_module="transformers.models.qwen3_moe.modeling_qwen3_moe",
    refuses=("hidden_act other than silu", "attention_bias true", "scaled RoPE",
             "use_sliding_window true with sliding_window smaller than max_position_embeddings",
             "mlp_only_layers naming a layer the model does not have, or no MoE layer left"),
)
