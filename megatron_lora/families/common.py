"""Readers of the config.json fields most families share (Llama-style attention, RoPE, dtype).

Each raises ModelConfigError naming the file and the field; a family's `read` calls them in the
order it wants its messages.
"""

from __future__ import annotations

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
