"""DeepSeek-V3 (DeepseekV3ForCausalLM, model_type deepseek_v3: DeepSeek-V3, R1, Kimi-K2,
Moonlight) and DeepSeek-V2 (DeepseekV2ForCausalLM, deepseek_v2: V2, V2-Lite), as transformers
5.24 builds them:

- multi-latent attention (models/mla.py): q_a_proj -> q_a_layernorm -> q_b_proj (or one q_proj
  when `q_lora_rank` is null, V2-Lite), kv_a_proj_with_mqa -> kv_a_layernorm on the latent ->
  kv_b_proj, o_proj; RoPE on the last `qk_rope_head_dim` channels of each query head and one
  shared key part (adjacent pairs: `rope_interleave`, true unless the config says otherwise),
  plain or YaRN (with `mscale_all_dim`, the softmax scale is multiplied by its mscale squared);
  value heads of `v_head_dim`;
- the first `first_k_dense_replace` layers dense (SwiGLU of `intermediate_size`), the others
  MoE: SwiGLU experts `mlp.experts.{e}.*` of `moe_intermediate_size` and a shared expert of
  `n_shared_experts` x `moe_intermediate_size` (`mlp.shared_experts.*`, no gate);
- V3 routing: sigmoid scores, `mlp.gate.e_score_correction_bias` to choose only (frozen: update
  rate 0), `n_group` / `topk_group` group-limited top-k scored by each group's top-2 sum,
  renormalised (`norm_topk_prob`), times `routed_scaling_factor` (families/common.py);
- V2 routing: the softmax over all experts taken at the top-k, not renormalised (transformers
  5.24 ignores `norm_topk_prob` for V2: true is refused as ambiguous), times
  `routed_scaling_factor`; `topk_method` "greedy", or "group_limited_greedy" (a group scored by
  its best expert) where megatron's group score is the same: num_experts_per_tok / topk_group
  = 1.

The multi-token-prediction layers after the decoder (`num_nextn_predict_layers`) are not built;
conversion carries them unchanged (convert/carried.py). Fine-grained FP8 checkpoints
(`quantization_config` quant_method fp8, 128x128 blocks) are dequantised as they are read
(convert/fp8.py).
"""

from __future__ import annotations

from megatron_lora.families.common import (dense_layers, make_shape, moe_sizes, read_activation,
                                           read_dtype, read_rope, refuse_true,
                                           sigmoid_group_routing)
from megatron_lora.families import hf_defaults
from megatron_lora.families.family import Family, HFNames
from megatron_lora.families.fields import Fields, ModelConfigError
from megatron_lora.families.shape import MlaShape
from megatron_lora.jsonfile import short


def _first_dense(f: Fields, num_layers: int) -> list:
    k = f.count("first_k_dense_replace", default=0)
    if not 0 <= k <= num_layers:
        raise f.bad("first_k_dense_replace", f"must be 0..{num_layers} (num_hidden_layers)", k)
    return [int(l >= k) for l in range(num_layers)]


def _v3_routing(f: Fields, experts: int, topk: int) -> dict:
    """DeepseekV3TopkRouter's fields; the original configs' scoring_func / topk_method, which
    transformers ignores, must say what it does (sigmoid, noaux_tc)."""
    for name, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        got = f.cfg.get(name, value)
        if got != value:
            raise ModelConfigError(f"{f.source}: field {name}={short(got)}: DeepSeek-V3 routes "
                                   f"with {name}={value!r} only")
    return sigmoid_group_routing(f, experts, topk)


def _v2_routing(f: Fields, experts: int, topk: int) -> dict:
    """DeepseekV2TopkRouter's fields: softmax at the top-k without renormalising."""
    if f.get("norm_topk_prob", bool, default=False):
        raise ModelConfigError(
            f"{f.source}: field norm_topk_prob=true: transformers 5.24 does not renormalise "
            f"DeepSeek-V2's routing weights (DeepSeek's own code does); set it to false")
    scoring = f.cfg.get("scoring_func", "softmax")
    if scoring != "softmax":
        raise ModelConfigError(f"{f.source}: field scoring_func={short(scoring)}: DeepSeek-V2 "
                               f"routes with 'softmax' only")
    method = f.get("topk_method", str, default="greedy", nullable=True) or "greedy"
    out = dict(moe_router_pre_softmax=True,
               moe_router_topk_scaling_factor=float(f.number("routed_scaling_factor",
                                                             default=1.0)))
    if method == "greedy":
        return out
    if method != "group_limited_greedy":
        raise ModelConfigError(f"{f.source}: field topk_method={short(method)}: only 'greedy' "
                               f"and 'group_limited_greedy' are supported")
    groups, keep = f.integer("n_group"), f.integer("topk_group")
    if experts % groups or keep > groups:
        raise ModelConfigError(f"{f.source}: field n_group={groups} / topk_group={keep}: n_group "
                               f"must divide the {experts} experts and topk_group <= n_group")
    if keep < groups:
        if topk // keep != 1 or topk > keep * (experts // groups):
            raise ModelConfigError(
                f"{f.source}: field topk_method='group_limited_greedy' with topk_group={keep}, "
                f"num_experts_per_tok={topk}: transformers scores a group by its best expert, "
                f"megatron-core by the sum of its top num_experts_per_tok / topk_group; only "
                f"configs where that is 1 are supported")
        out.update(moe_router_num_groups=groups, moe_router_group_topk=keep)
    return out


def _mla(f: Fields, heads: int) -> MlaShape:
    q_lora = f.integer("q_lora_rank", default=None, nullable=True)
    interleave = f.get("rope_interleave", bool, default=True, nullable=True)
    if f.integer("qk_rope_head_dim") % 2:
        raise f.bad("qk_rope_head_dim", "must be even (rope rotates channel pairs)",
                    f.cfg["qk_rope_head_dim"])
    return MlaShape(q_lora_rank=q_lora, kv_lora_rank=f.integer("kv_lora_rank"),
                    qk_head_dim=f.integer("qk_nope_head_dim"),
                    qk_pos_emb_head_dim=f.integer("qk_rope_head_dim"),
                    v_head_dim=f.integer("v_head_dim"),
                    rope_interleaved=True if interleave is None else interleave)


def read(f: Fields, cfg: dict, v2: bool = False):
    heads = f.integer("num_attention_heads")
    hidden = f.integer("hidden_size")
    vocab = f.integer("vocab_size")
    read_activation(f)
    refuse_true(f, "attention_bias", "mlp_bias")
    dropout = f.cfg.get("attention_dropout", 0.0)
    if dropout not in (0, 0.0, None):
        raise ModelConfigError(f"{f.source}: field attention_dropout={short(dropout)}: only 0")
    # typed only: multi-latent attention has one key head per query head whatever it says
    # (transformers' DeepseekV3Config defaults it to 128 at any size, and ignores it)
    f.integer("num_key_value_heads", default=None, nullable=True)
    if f.cfg.get("moe_layer_freq", 1) != 1:  # the original configs' field; transformers ignores it
        raise f.bad("moe_layer_freq", "must be 1 (the MoE layers are those after "
                    "first_k_dense_replace)", f.cfg["moe_layer_freq"])
    max_pos = f.integer("max_position_embeddings", default=2048 if v2 else 4096)
    theta, yarn = read_rope(f, 10000.0, max_pos, scaled=("yarn",))
    if yarn is not None and not yarn.truncate:
        raise ModelConfigError(f"{f.source}: field truncate=false: megatron's multi-latent "
                               f"attention always rounds the YaRN correction range")
    if yarn is not None and yarn.mscale_all_dim and not yarn.mscale:
        raise ModelConfigError(f"{f.source}: field mscale_all_dim={yarn.mscale_all_dim} without "
                               f"mscale: transformers then scales cos/sin by the plain YaRN "
                               f"factor, megatron by the mscale ratio")
    dtype = read_dtype(f)
    f.count("num_nextn_predict_layers", default=0)  # typed; the layers are skipped
    experts = lambda g: g.integer("n_routed_experts")  # noqa: E731
    sizes = moe_sizes(f, "moe_intermediate_size", experts, 1e-6, norm_topk_prob=False)
    routing = _v2_routing if v2 else _v3_routing
    sizes.update(routing(f, sizes["num_experts"], sizes["moe_router_topk"]))
    shared = f.count("n_shared_experts", default=None, nullable=True)
    if shared:
        sizes["shared_expert_ffn_hidden_size"] = sizes["ffn_hidden_size"] * shared
    sizes.update(dense_layers(f, _first_dense(f, sizes["num_layers"])))
    mla = _mla(f, heads)
    shape = make_shape(f, vocab, hidden_size=hidden, num_attention_heads=heads,
                       num_query_groups=heads, max_position_embeddings=max_pos,
                       rotary_base=theta, yarn=yarn, kv_channels=mla.q_head_dim, mla=mla,
                       **sizes)
    return shape, vocab, dtype


NAMES = HFNames(router="mlp.gate.weight", expert="mlp.experts.{e}.",
                expert_gate="gate_proj.weight", expert_up="up_proj.weight",
                expert_down="down_proj.weight", shared_expert="mlp.shared_experts.", mla=True)
REFUSES = ("hidden_act other than silu", "attention_bias or mlp_bias true",
           "attention_dropout > 0",
           "RoPE scaling other than YaRN; YaRN with truncate false, an explicit "
           "attention_factor, or mscale_all_dim without mscale", "moe_layer_freq other than 1")

DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    hf_defaults=hf_defaults.DEEPSEEK_V3,
    architectures=("DeepseekV3ForCausalLM",),
    model_types=("deepseek_v3",),
    read=read,
    names=NAMES,
    experts_field="n_routed_experts",
    ffn_field="moe_intermediate_size",
    transformers_module="transformers.models.deepseek_v3.modeling_deepseek_v3",
    extra_layers_field="num_nextn_predict_layers",
    refuses=REFUSES + ("scoring_func other than sigmoid, topk_method other than noaux_tc",
                       "norm_topk_prob false with num_experts_per_tok > 1 (or true with 1)",
                       "group-limited routing with num_experts_per_tok / topk_group != 2"),
)

DEEPSEEK_V2 = Family(
    name="deepseek_v2",
    hf_defaults=hf_defaults.DEEPSEEK_V2,
    architectures=("DeepseekV2ForCausalLM",),
    model_types=("deepseek_v2",),
    read=lambda f, cfg: read(f, cfg, v2=True),
    names=NAMES,
    experts_field="n_routed_experts",
    ffn_field="moe_intermediate_size",
    transformers_module="transformers.models.deepseek_v2.modeling_deepseek_v2",
    extra_layers_field="num_nextn_predict_layers",
    refuses=REFUSES + ("norm_topk_prob true (transformers 5.24 does not renormalise V2's "
                       "weights)", "scoring_func other than softmax",
                       "group_limited_greedy with num_experts_per_tok / topk_group != 1"),
)
