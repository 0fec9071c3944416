"""Readers of the config.json fields most families share (Llama-style attention, RoPE, dtype).

Each raises ModelConfigError naming the file and the field; a family's `read` calls them in the
order it wants its messages.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_lora.families.fields import Fields, ModelConfigError
from megatron_lora.families.shape import ModelShape, padded_vocab_size
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


def read_rope_theta(f: Fields, default: float = 1e6) -> float:
    """The RoPE base of plain (unscaled) RoPE, from `rope_parameters` (transformers 5) or the
    top-level `rope_theta`; scaled RoPE is refused."""
    rope = f.get("rope_parameters", dict, default=None, nullable=True) or {}
    scaling = f.get("rope_scaling", dict, default=None, nullable=True) or {}
    rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ModelConfigError(f"{f.source}: field rope_type={short(rope_type)}: only unscaled "
                               f"('default') RoPE is supported")
    if "rope_theta" in rope:
        theta = Fields(rope, f.source, "rope_parameters.").number("rope_theta")
    else:
        theta = f.number("rope_theta", default=default)
    if float(theta) != int(theta):
        raise f.bad("rope_theta", "must be a positive whole number", theta)
    return float(theta)


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
    if norm_topk_prob:
        sizes["moe_router_pre_softmax"] = not f.get("norm_topk_prob", bool, default=False)
    return sizes
