"""GLM-4.5 (Glm4MoeForCausalLM, model_type glm4_moe: GLM-4.5, GLM-4.5-Air): GQA with q/k/v
biases (`attention_bias`; o_proj has none), an optional RMSNorm over each query and key head
(`use_qk_norm`), RoPE on the first `partial_rotary_factor` of each head (rotate-half, the rest
passed through: megatron's rotary_percent), the first `first_k_dense_replace` layers dense
(SwiGLU of `intermediate_size`, `mlp.gate_proj/up_proj/down_proj`), the others MoE:

- routing by sigmoid scores; `mlp.gate.e_score_correction_bias` is added to the scores to choose
  the experts only (megatron's router `expert_bias`, its update rate set to 0 so that training
  never moves it); `n_group` groups of which `topk_group` are kept, a group scored by the sum of
  its two best scores; the chosen scores renormalised (`norm_topk_prob`) and multiplied by
  `routed_scaling_factor`;
- SwiGLU experts `mlp.experts.{e}.gate_proj/up_proj/down_proj` of `moe_intermediate_size`, and
  a shared expert of `n_shared_experts` x `moe_intermediate_size` beside them
  (`mlp.shared_experts.*`, no gate).

The `num_nextn_predict_layers` multi-token-prediction layers (`model.layers.{L}...` after the
`num_hidden_layers` decoder layers) are not built; conversion says so and carries their tensors
unchanged back to HF (convert/carried.py).

Refused, naming the field: other activations, scaled RoPE, attention dropout, a rotary width
that is not an even number of channels, `norm_topk_prob` false with more than one expert per
token or true with one (megatron renormalises the sigmoid scores exactly when top-k > 1),
`n_group` not dividing the experts, and a group-limited routing megatron scores otherwise
(it sums a group's top `num_experts_per_tok / topk_group` scores, transformers its top 2).
"""

from __future__ import annotations

from megatron_lora.families.common import (dense_layers, make_shape, moe_sizes, read_activation,
                                           read_dtype, read_rope_theta, sigmoid_group_routing)
from megatron_lora.families import hf_defaults
from megatron_lora.families.family import Family, HFNames
from megatron_lora.families.fields import Fields, ModelConfigError
from megatron_lora.jsonfile import short


def _rotary_percent(f: Fields, head_dim: int) -> float:
    """`partial_rotary_factor` (in `rope_parameters` as transformers 5 saves it, or top level as
    the published configs do; transformers' default 0.5), checked to give an even width."""
    rope = f.get("rope_parameters", dict, default=None, nullable=True) or {}
    if "partial_rotary_factor" in rope:
        factor = Fields(rope, f.source, "rope_parameters.").number("partial_rotary_factor")
    else:
        factor = f.number("partial_rotary_factor", default=0.5)
    width = int(head_dim * factor)
    if factor > 1 or width < 2 or width % 2:
        raise f.bad("partial_rotary_factor", f"must give an even rotary width in 2..{head_dim} "
                    f"(head_dim={head_dim} x factor = {width})", factor)
    return float(factor)


def _first_dense(f: Fields, num_layers: int) -> list:
    k = f.count("first_k_dense_replace", default=1)
    if not 0 <= k <= num_layers:
        raise f.bad("first_k_dense_replace", f"must be 0..{num_layers} (num_hidden_layers)", k)
    return [int(l >= k) for l in range(num_layers)]


def read(f: Fields, cfg: dict):
    heads = f.integer("num_attention_heads")
    hidden = f.integer("hidden_size")
    vocab = f.integer("vocab_size")
    read_activation(f)
    head_dim = f.integer("head_dim", default=None, nullable=True)
    dropout = f.cfg.get("attention_dropout", 0.0)
    if dropout not in (0, 0.0):
        raise ModelConfigError(f"{f.source}: field attention_dropout={short(dropout)}: only 0")
    theta = read_rope_theta(f, default=10000.0)
    max_pos = f.integer("max_position_embeddings", default=131072)
    dtype = read_dtype(f)
    kv_heads = f.integer("num_key_value_heads", default=heads, nullable=True)
    f.count("num_nextn_predict_layers", default=0)  # typed; the layers are skipped
    experts = lambda g: g.integer("n_routed_experts")  # noqa: E731
    sizes = moe_sizes(f, "moe_intermediate_size", experts, 1e-5, norm_topk_prob=False)
    sizes.update(sigmoid_group_routing(f, sizes["num_experts"], sizes["moe_router_topk"]))
    sizes["shared_expert_ffn_hidden_size"] = (sizes["ffn_hidden_size"]
                                              * f.integer("n_shared_experts", default=1))
    sizes.update(dense_layers(f, _first_dense(f, sizes["num_layers"])))
    rotary = _rotary_percent(f, head_dim or (hidden // heads if hidden % heads == 0 else 1))
    shape = make_shape(f, vocab, hidden_size=hidden, num_attention_heads=heads,
                       num_query_groups=heads if kv_heads is None else kv_heads,
                       max_position_embeddings=max_pos, rotary_base=theta, kv_channels=head_dim,
                       add_qkv_bias=f.get("attention_bias", bool, default=False),
                       qk_layernorm=f.get("use_qk_norm", bool, default=False),
                       rotary_percent=rotary, **sizes)
    return shape, vocab, dtype


GLM4_MOE = Family(
    name="glm4_moe",
    hf_defaults=hf_defaults.GLM4_MOE,
    architectures=("Glm4MoeForCausalLM",),
    model_types=("glm4_moe",),
    read=read,
    names=HFNames(router="mlp.gate.weight", expert="mlp.experts.{e}.",
                  expert_gate="gate_proj.weight", expert_up="up_proj.weight",
                  expert_down="down_proj.weight", shared_expert="mlp.shared_experts."),
    experts_field="n_routed_experts",
    ffn_field="moe_intermediate_size",
    transformers_module="transformers.models.glm4_moe.modeling_glm4_moe",
    extra_layers_field="num_nextn_predict_layers",
    refuses=("hidden_act other than silu", "scaled RoPE", "attention_dropout > 0",
             "partial_rotary_factor giving an odd or empty rotary width",
             "norm_topk_prob false with num_experts_per_tok > 1 (or true with 1)",
             "n_group not dividing n_routed_experts, topk_group > n_group",
             "group-limited routing with num_experts_per_tok / topk_group != 2"),
)
