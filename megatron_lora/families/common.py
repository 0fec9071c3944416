"""Readers of the config.json fields most families share (Llama-style attention, RoPE and its
YaRN scaling, dtype).

Each raises ModelConfigError naming the file and the field; a family's `read` calls them in the
order it wants its messages.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from megatron_lora.families.fields import Fields, ModelConfigError
from megatron_lora.families.shape import ModelShape, YarnRope, padded_vocab_size
from megatron_lora.jsonfile import short

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_activation(f: Fields) -> None:
    act = f.get("hidden_act", str, default="silu")
    if act != "silu":
        raise ModelConfigError(f"{f.source}: field hidden_act={short(act)}: only 'silu' is supported")


def refuse_true(f: Fields, *names: str, why: str = "biases are not supported") -> None:
    """Refuse each boolean field of `names` that is true."""
    for name in names:
        if f.get(name, bool, default=False):
            raise ModelConfigError(f"{f.source}: field {name}=true: {why}")


def rope_fields(f: Fields, default: Optional[dict] = None) -> Tuple[Fields, str]:
    """The RoPE parameters object transformers 5.24 reads (`rope_scaling` when it is a non-empty
    object, as older and the published GPT-OSS configs write it; else `rope_parameters`; when
    that is missing or null, the family config class's `default` (GptOssConfig's is YaRN), or
    {}) as Fields naming it in messages (`rope_scaling.factor`), and its rope type."""
    scaling = f.get("rope_scaling", dict, default=None, nullable=True)
    params = f.get("rope_parameters", dict, default=None, nullable=True)
    name, params = ("rope_scaling", scaling) if scaling else (
        "rope_parameters", dict(default or {}) if params is None else params)
    nested = [k for k, v in params.items() if isinstance(v, dict)]
    if nested:
        raise ModelConfigError(f"{f.source}: field '{name}.{nested[0]}' is an object: RoPE "
                               f"parameters per layer type are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str):
        raise ModelConfigError(f"{f.source}: field '{name}.rope_type' must be a string, got "
                               f"{short(rope_type)}")
    return Fields(params, f.source, name + "."), rope_type


def read_rope(f: Fields, default_theta: float, max_pos: int, scaled: Tuple[str, ...] = (),
              default: Optional[dict] = None) -> Tuple[float, Optional[YarnRope]]:
    """(RoPE base, YaRN parameters or None) of the config; the RoPE types in `scaled` ("yarn")
    are read (read_yarn), any other scaled RoPE is refused. The base is the parameters object's
    `rope_theta`, else the top-level `rope_theta`, else `default_theta` (the family's
    transformers default); `max_pos` is the model's max_position_embeddings; `default`: the
    parameters transformers' config class sets when the config has none (rope_fields)."""
    p, rope_type = rope_fields(f, default)
    if rope_type != "default" and rope_type not in scaled:
        allowed = " or ".join(["unscaled ('default')"] + [repr(t) for t in scaled])
        raise ModelConfigError(f"{f.source}: field rope_type={short(rope_type)}: only {allowed} "
                               f"RoPE is supported")
    if "rope_theta" in p.cfg:
        theta = p.number("rope_theta")
    else:
        theta = f.number("rope_theta", default=default_theta)
    if float(theta) != int(theta):
        raise f.bad("rope_theta", "must be a positive whole number", theta)
    yarn = read_yarn(f, p, max_pos) if rope_type == "yarn" else None
    return float(theta), yarn


def read_rope_theta(f: Fields, default: float = 1e6) -> float:
    """The RoPE base of plain (unscaled) RoPE; scaled RoPE is refused."""
    return read_rope(f, default, max_pos=1)[0]


YARN_KEYS = ("rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings",
             "beta_fast", "beta_slow", "truncate", "mscale", "mscale_all_dim",
             "attention_factor", "partial_rotary_factor")


def _optional_scale(p: Fields, name: str) -> Optional[float]:
    value = p.cfg.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
            or value == float("inf"):
        raise p.bad(name, "must be a number >= 0 or null", value)
    return float(value)


def read_yarn(f: Fields, p: Fields, max_pos: int) -> YarnRope:
    """The validated YaRN parameters of RoPE parameters `p` (rope_fields) as transformers 5.24
    reads them: `factor` (required, >= 1); `original_max_position_embeddings` from the top level
    when the config has it there (transformers prefers it), else from `p`, else `max_pos`;
    `beta_fast` / `beta_slow` (default 32 / 1); `truncate` (default true); `mscale` /
    `mscale_all_dim` (the attention factor is their ratio when both are non-zero: YarnRope).
    Refused, naming the field: unknown keys, an explicit `attention_factor`, and
    `partial_rotary_factor` other than 1 (megatron's YaRN rotates the whole head)."""
    unknown = [k for k in p.cfg if k not in YARN_KEYS]
    if unknown:
        raise ModelConfigError(f"{f.source}: field '{p.prefix}{unknown[0]}' is not a YaRN "
                               f"parameter (known: {', '.join(YARN_KEYS)})")
    factor = p.number("factor")
    if factor < 1:
        raise p.bad("factor", "must be a number >= 1", factor)
    if p.cfg.get("attention_factor") is not None:
        raise p.bad("attention_factor", "is not supported (the attention factor is derived from "
                    "factor, mscale and mscale_all_dim); remove it", p.cfg["attention_factor"])
    partial = p if "partial_rotary_factor" in p.cfg else f
    if partial.cfg.get("partial_rotary_factor", 1.0) not in (1, 1.0):
        raise partial.bad("partial_rotary_factor", "must be 1 with YaRN (YaRN on part of each "
                          "head is not supported)", partial.cfg["partial_rotary_factor"])
    if "original_max_position_embeddings" in f.cfg:
        original = f.integer("original_max_position_embeddings")
    else:
        original = p.integer("original_max_position_embeddings", default=max_pos)
    betas = {}
    for name, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        betas[name] = float(default if p.cfg.get(name) is None else p.number(name))
    return YarnRope(factor=float(factor), original_max_position_embeddings=original,
                    truncate=p.get("truncate", bool, default=True),
                    mscale=_optional_scale(p, "mscale"),
                    mscale_all_dim=_optional_scale(p, "mscale_all_dim"), **betas)


def refuse_sliding_window(f: Fields, max_pos: int, use_field: str = None) -> None:
    """Refuse an effective sliding window (one smaller than the context); `use_field` names a
    boolean that switches the window off when false (Qwen's `use_sliding_window`)."""
    if use_field is not None and not f.get(use_field, bool, default=False):
        return
    window = f.integer("sliding_window", default=None, nullable=True)
    if window is not None and window < max_pos:
        raise ModelConfigError(
            f"{f.source}: field sliding_window={window} is smaller than max_position_embeddings="
            f"{max_pos}; sliding-window attention is not supported"
        )


def read_dtype(f: Fields) -> torch.dtype:
    name = f.get("dtype", str, default=None, nullable=True)
    if name is None:
        name = f.get("torch_dtype", str, default=None, nullable=True) or "float32"
    if name not in DTYPES:
        raise ModelConfigError(f"{f.source}: field dtype={name!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def make_shape(f: Fields, vocab: int, **sizes) -> ModelShape:
    """ModelShape with the padded vocabulary; a derived-size error names the file."""
    try:
        return ModelShape(vocab_size=padded_vocab_size(vocab), **sizes)
    except ValueError as exc:
        raise ModelConfigError(
            f"{f.source}: {str(exc).replace('ModelShape.', 'derived ')}") from exc


def num_experts(f: Fields) -> int:
    """`num_experts` as the hub's Qwen/OLMoE configs write it; transformers 5 saves it as
    `num_local_experts` (its attribute alias)."""
    if "num_experts" in f.cfg or "num_local_experts" not in f.cfg:
        return f.integer("num_experts")
    return f.integer("num_local_experts")


def dense_layers(f: Fields, pattern, ffn_field: str = "intermediate_size") -> dict:
    """The ModelShape fields of a decoder with dense layers between its MoE layers: `pattern` is
    per layer 1 (MoE) or 0 (dense, a SwiGLU MLP of the config's `ffn_field`); {} when every layer
    is MoE (such models keep megatron's stacked checkpoint layout). Shared by the families that
    place dense layers by a list (Qwen's `mlp_only_layers`) or a count (`first_k_dense_replace`)."""
    pattern = tuple(int(bool(x)) for x in pattern)
    if 0 not in pattern:
        return {}
    if 1 not in pattern:
        raise ModelConfigError(f"{f.source}: every layer is dense (no MoE layer); dense models "
                               f"are not supported")
    return dict(moe_layer_pattern=pattern, dense_ffn_hidden_size=f.integer(ffn_field))


def qwen_moe_layers(f: Fields, num_layers: int) -> list:
    """Qwen's MoE layers as transformers builds them: layer l is sparse iff l is not in
    `mlp_only_layers` and (l + 1) % `decoder_sparse_step` == 0 (num_experts > 0 is read
    elsewhere); a listed layer outside the model is refused rather than ignored."""
    dense = f.get("mlp_only_layers", list, default=[], nullable=True) or []
    bad = [x for x in dense if isinstance(x, bool) or not isinstance(x, int)
           or not 0 <= x < num_layers]
    if bad:
        raise ModelConfigError(f"{f.source}: field mlp_only_layers={short(dense)}: "
                               f"{short(bad[0])} is not a layer index 0..{num_layers - 1} "
                               f"(num_hidden_layers={num_layers})")
    step = f.integer("decoder_sparse_step", default=1)
    return [int(l not in dense and (l + 1) % step == 0) for l in range(num_layers)]


def moe_sizes(f: Fields, ffn_field: str, experts: Callable[[Fields], int], eps: float,
              norm_topk_prob: bool) -> dict:
    """The ModelShape fields of a decoder of MoE layers: expert FFN size from `ffn_field`, layers,
    experts (read by `experts`), top-k, RMSNorm eps (default `eps`), tied embeddings; with `norm_topk_prob`, the
    config's `norm_topk_prob` (false: plain top-k weights, megatron's pre-softmax routing).
    Read before the shape is made: a field error is not a derived-size error."""
    sizes = dict(ffn_hidden_size=f.integer(ffn_field), num_layers=f.integer("num_hidden_layers"),
                 num_experts=experts(f), moe_router_topk=f.integer("num_experts_per_tok"),
                 norm_epsilon=float(f.number("rms_norm_eps", default=eps)),
                 tie_embeddings=f.get("tie_word_embeddings", bool, default=False))
    if sizes["moe_router_topk"] > sizes["num_experts"]:  # before any routing-specific check
        raise f.bad("num_experts_per_tok", f"must be <= num_experts ({sizes['num_experts']})",
                    sizes["moe_router_topk"])
    if norm_topk_prob:
        sizes["moe_router_pre_softmax"] = not f.get("norm_topk_prob", bool, default=False)
    return sizes


def sigmoid_group_routing(f: Fields, experts: int, topk: int) -> dict:
    """The ModelShape router fields of transformers' sigmoid top-k routers with a score-correction
    bias (Glm4MoeTopkRouter, DeepseekV3TopkRouter: `norm_topk_prob`, `n_group`, `topk_group`,
    `routed_scaling_factor`), or ModelConfigError naming the field megatron-core's sigmoid router
    cannot follow."""
    norm = f.get("norm_topk_prob", bool, default=True)
    if norm != (topk > 1):
        raise ModelConfigError(
            f"{f.source}: field norm_topk_prob={str(norm).lower()} with num_experts_per_tok={topk}: "
            f"megatron-core renormalises the sigmoid scores exactly when more than one expert "
            f"is chosen; only norm_topk_prob={str(topk > 1).lower()} is supported here")
    groups = f.integer("n_group", default=1)
    keep = f.integer("topk_group", default=1)
    if experts % groups:
        raise f.bad("n_group", f"must divide the {experts} experts (n_routed_experts)", groups)
    if keep > groups:
        raise f.bad("topk_group", f"must be at most n_group={groups}", keep)
    out = dict(moe_router_score_function="sigmoid", moe_router_expert_bias=True,
               moe_router_topk_scaling_factor=float(f.number("routed_scaling_factor",
                                                             default=1.0)))
    if keep < groups:  # with every group kept, group routing is plain top-k
        if experts // groups < 2 or topk // keep != 2:
            raise ModelConfigError(
                f"{f.source}: field topk_group={keep} (n_group={groups}, num_experts_per_tok="
                f"{topk}): megatron-core scores a group by its top num_experts_per_tok / "
                f"topk_group experts, transformers by its top 2; only configs where that is 2 "
                f"(and every group has 2 or more experts) are supported")
        out.update(moe_router_num_groups=groups, moe_router_group_topk=keep)
    return out
