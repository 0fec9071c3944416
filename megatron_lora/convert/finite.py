"""Refuse non-finite weights and unusable quantisation scales as tensors are read.

A NaN or inf in a checkpoint (a weight, or an FP8 block scale that multiplies a whole block)
otherwise converts, loads and trains silently into NaN logits and a NaN loss. The checks are one
vectorised pass over each piece read (`torch.isfinite(x).all()`); only a failing piece is
searched for its first bad element, which the message names with its index in the whole tensor.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from megatron_lora.convert.errors import ConversionError

# float8 bit patterns: e4m3fn has no inf, NaN is S.1111.111; e5m2 is IEEE-like (exponent 11111).
_FP8_BAD = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C)}


def bad_mask(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """A bool mask of `tensor`'s NaN / inf elements, or None when every element is finite (or
    the dtype is not floating point)."""
    if tensor.dtype in _FP8_BAD:
        mask, value = _FP8_BAD[tensor.dtype]
        bad = (tensor.view(torch.uint8) & mask) == value
    elif tensor.dtype.is_floating_point:
        bad = ~torch.isfinite(tensor)
    else:
        return None
    return bad if bool(bad.any()) else None


def _first(tensor: torch.Tensor, bad: torch.Tensor, offset: Sequence[int]):
    """(index of the first True of `bad` in the whole tensor, `tensor`'s value there as a
    float); `offset`: where the piece starts on each leading axis."""
    flat = int(torch.nonzero(bad.reshape(-1))[0])
    local = list(torch.unravel_index(torch.tensor(flat, device=bad.device), bad.shape)) \
        if bad.dim() else []
    offset = list(offset) + [0] * (len(local) - len(offset))
    return ([int(i) + int(o) for i, o in zip(local, offset)],
            float(tensor.reshape(-1)[flat].float()))


def check_finite(tensor: torch.Tensor, name: str, path: str,
                 offset: Sequence[int] = ()) -> None:
    """ConversionError naming the file, the tensor and its first NaN / inf element."""
    bad = bad_mask(tensor)
    if bad is None:
        return
    at, value = _first(tensor, bad, offset)
    raise ConversionError(
        f"{path}: tensor {name!r} holds {int(bad.sum())} non-finite value(s) in the part read "
        f"(first: {value} at index {at}); the checkpoint is corrupt: re-download or re-export it")


def check_scales(scale: torch.Tensor, name: str, path: str, block: Tuple[int, int],
                 offset: Sequence[int] = ()) -> None:
    """ConversionError naming the file, the scale tensor and the first block whose scale is not
    a positive finite number (NaN, inf, zero or negative)."""
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if not bool(bad.any()):
        return
    at, value = _first(scale, bad, offset)
    *lead, r, c = at
    raise ConversionError(
        f"{path}: tensor {name!r} holds {int(bad.sum())} block scale(s) that are not positive "
        f"finite numbers (first: {value} at index {list(at)}: the {block[0]}x{block[1]} block of "
        f"rows {r * block[0]}.. and columns {c * block[1]}..{' of ' + str(lead) if lead else ''}"
        f"); the checkpoint is corrupt: re-download or re-export it")
