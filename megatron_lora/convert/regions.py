"""Boxes in global tensor coordinates, and assembling a box from the stored chunks that cover it.

A chunk is a box (offsets, sizes) of a global tensor whose data some `fetch(index)` can produce,
where `index` is a tuple of slices relative to the chunk. Both checkpoint sides use this: the HF
side (chunks defined by the mapping table, fetched from safetensors slices) and the megatron side
(chunks as stored in a torch_dist checkpoint, fetched from its files).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes)


def intersect(a_off, a_size, b_off, b_size) -> Optional[Box]:
    """The intersection of two boxes, or None when they do not overlap."""
    lo = [max(a, b) for a, b in zip(a_off, b_off)]
    hi = [min(a + s, b + t) for a, s, b, t in zip(a_off, a_size, b_off, b_size)]
    if any(h <= l for l, h in zip(lo, hi)):
        return None
    return tuple(lo), tuple(h - l for l, h in zip(lo, hi))


def relative(box: Box, origin: Sequence[int]) -> Tuple[slice, ...]:
    """Slices selecting `box` inside a tensor whose first element sits at `origin`."""
    off, size = box
    return tuple(slice(o - g, o - g + s) for o, s, g in zip(off, size, origin))


def volume(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def assemble(
    offsets: Sequence[int],
    sizes: Sequence[int],
    chunks: Sequence[Tuple[Sequence[int], Sequence[int], Callable[[Tuple[slice, ...]], torch.Tensor]]],
    dtype: torch.dtype,
    what: str,
) -> torch.Tensor:
    """The box (offsets, sizes) of a global tensor, built from the chunks that overlap it.

    chunks: (chunk_offsets, chunk_sizes, fetch) where fetch(slices relative to the chunk) returns
    exactly that part of the chunk. A chunk equal to the box is returned as fetched (no copy).
    Raises ValueError naming `what` if the chunks do not cover the box.
    """
    offsets, sizes = tuple(offsets), tuple(sizes)
    parts = []
    for c_off, c_size, fetch in chunks:
        box = intersect(offsets, sizes, tuple(c_off), tuple(c_size))
        if box is not None:
            parts.append((box, tuple(c_off), fetch))
    covered = sum(volume(box[1]) for box, _, _ in parts)
    if covered != volume(sizes):
        raise ValueError(
            f"{what}: stored chunks cover {covered} of the {volume(sizes)} elements of box "
            f"offsets={list(offsets)} sizes={list(sizes)}"
        )
    if len(parts) == 1 and parts[0][0] == (offsets, sizes):
        box, c_off, fetch = parts[0]
        return fetch(relative(box, c_off)).reshape(sizes)
    out = torch.empty(sizes, dtype=dtype, device="cpu")
    for box, c_off, fetch in parts:
        out[relative(box, offsets)] = fetch(relative(box, c_off)).reshape(box[1])
    return out
