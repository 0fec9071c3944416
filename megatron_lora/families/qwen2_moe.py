"""Qwen2-MoE (Qwen2MoeForCausalLM: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Llama attention with q/k/v
biases (`qkv_bias`, no o_proj bias), softmax routing over `num_experts` experts (`norm_topk_prob`
false: plain top-k weights), SwiGLU experts `mlp.experts.{e}.gate_proj/up_proj/down_proj`, router
`mlp.gate`, and a shared expert beside them (`mlp.shared_expert.*`, every token) whose output is
scaled by sigmoid(`mlp.shared_expert_gate`): megatron-core's SharedExpertMLP with its gate.

Dense layers between the MoE layers (`mlp_only_layers`, `decoder_sparse_step` > 1) are SwiGLU
MLPs of `intermediate_size` (`mlp.gate_proj/up_proj/down_proj`, no shared expert).

Refused: other activations, scaled RoPE, an effective sliding window (`use_sliding_window`), a
model with no MoE layer left, a model without a shared expert (`shared_expert_intermediate_size`
0: it must be a positive integer).
"""

from __future__ import annotations

from megatron_lora.families.common import (dense_layers, make_shape, moe_sizes, num_experts,
                                           qwen_moe_layers, read_activation, read_dtype,
                                           read_rope_theta, refuse_sliding_window)
from megatron_lora.families import hf_defaults
from megatron_lora.families.family import Family, HFNames
from megatron_lora.families.fields import Fields


def read(f: Fields, cfg: dict):
    heads = f.integer("num_attention_heads")
    hidden = f.integer("hidden_size")
    vocab = f.integer("vocab_size")
    read_activation(f)
    theta = read_rope_theta(f, default=10000.0)
    max_pos = f.integer("max_position_embeddings", default=32768)
    refuse_sliding_window(f, max_pos, use_field="use_sliding_window")
    dtype = read_dtype(f)
    kv_heads = f.integer("num_key_value_heads", default=heads, nullable=True)
    sizes = dict(moe_sizes(f, "moe_intermediate_size", num_experts, 1e-6, norm_topk_prob=True),
                 add_qkv_bias=f.get("qkv_bias", bool, default=True),
                 shared_expert_ffn_hidden_size=f.integer("shared_expert_intermediate_size",
                                                         default=5632),
                 shared_expert_gate=True)
    sizes.update(dense_layers(f, qwen_moe_layers(f, sizes["num_layers"])))
    shape = make_shape(f, vocab, hidden_size=hidden, num_attention_heads=heads,
                       num_query_groups=heads if kv_heads is None else kv_heads,
                       max_position_embeddings=max_pos, rotary_base=theta, **sizes)
    return shape, vocab, dtype


QWEN2_MOE = Family(
    name="qwen2_moe",
    hf_defaults=hf_defaults.QWEN2_MOE,
    architectures=("Qwen2MoeForCausalLM",),
    model_types=("qwen2_moe",),
    read=read,
    names=HFNames(router="mlp.gate.weight", expert="mlp.experts.{e}.",
                  expert_gate="gate_proj.weight", expert_up="up_proj.weight",
                  expert_down="down_proj.weight"),
    experts_field="num_experts",
    ffn_field="moe_intermediate_size",
    transformers_module="transformers.models.qwen2_moe.modeling_qwen2_moe",
    # PEFT 0.21 maps per-expert names onto transformers 5's fused experts for the models that
    # share Qwen2-MoE's layout (qwen3_moe, olmoe, ...) but not for qwen2_moe itself.
    peft_fused_experts=True,
    refuses=("hidden_act other than silu", "scaled RoPE",
             "use_sliding_window true with sliding_window smaller than max_position_embeddings",
             "mlp_only_layers naming a layer the model does not have, or no MoE layer left",
             "shared_expert_intermediate_size 0"),
)
