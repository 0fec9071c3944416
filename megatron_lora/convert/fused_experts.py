"""Experts stored fused per layer (GPT-OSS) as chunk sources of the conversion mapping.

transformers keeps each layer's experts as 3-D tensors in [E, in, out] orientation:
`gate_up_proj` [E, h, 2f] with gate and up interleaved on the last axis (column 2j is gate j,
2j + 1 is up j), `down_proj` [E, f, h], and biases `gate_up_proj_bias` [E, 2f] (interleaved the
same way) and `down_proj_bias` [E, h]. megatron's experts are [E, out, in] with fc1's rows
[gate; up]. A `FusedExperts` source is one layer's whole megatron tensor ([E, 2f, h], [E, h, f],
[E, 2f] or [E, h]); reading a box reads only its experts (a rank's local ones on --load-hf, one
layer on hf-to-mcore), and `split` writes transformers' layout back.

MXFP4 checkpoints store `gate_up_proj` / `down_proj` as `*_blocks` / `*_scales`; a weight source
reads them one expert at a time through convert/mxfp4.py (in the dtype of the checkpoint's other
tensors), the rows already in megatron's [out, in] orientation.

An adapter sits on one expert of such a tensor: `OneExpert` is expert e's [out, in] rows as the
adapter table (export/table.py) sees them, named as a per-expert module
`{layer}mlp.experts.{e}.gate_up_proj` that transformers does not have (PEFT adapts the layer's
fused parameter, export/peft_fused.py), with the row order of transformers' out axis.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from megatron_lora.convert import mxfp4


def _gate_up_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved (gate, up, gate, up, ...) along `dim` -> [gate; up]."""
    index = [slice(None)] * t.dim()
    index[dim] = slice(0, None, 2)
    gate = t[tuple(index)]
    index[dim] = slice(1, None, 2)
    return torch.cat([gate, t[tuple(index)]], dim=dim)


def _interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[gate; up] along `dim` -> interleaved (the inverse of _gate_up_rows)."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


class FusedExperts:
    """One layer's fused expert tensor `name`: HF shape `hf_shape`; weight: HF [E, in, out]
    (transposed to megatron's [E, out, in]) else a bias [E, out]; gate_up: the out axis holds
    gate and up interleaved (megatron: [gate; up]); dtype: MXFP4 weights' dequantised dtype."""

    def __init__(self, name: str, hf_shape: Tuple[int, ...], weight: bool, gate_up: bool,
                 dtype: torch.dtype = torch.float32):
        self.name, self.hf_shape = name, tuple(hf_shape)
        self.weight, self.gate_up, self.dtype = weight, gate_up, dtype
        e = self.hf_shape[0]
        self.shape = (e, self.hf_shape[2], self.hf_shape[1]) if weight else self.hf_shape

    def hf_shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {self.name: self.hf_shape}

    def _megatron(self, t: torch.Tensor) -> torch.Tensor:
        """HF-oriented experts [k, in, out] (or [k, out]) -> megatron's [k, out, in] ([k, out])."""
        if self.weight:
            t = t.transpose(1, 2)
        return _gate_up_rows(t, 1) if self.gate_up else t

    def read(self, reader, index) -> torch.Tensor:
        experts, rest = index[0], tuple(index[1:])
        if self.weight and f"{self.name}_blocks" in reader.tensors:
            # MXFP4: expert e's dequantised [out, in] is HF's [in, out] transposed already.
            parts = [mxfp4.read_expert(reader, self.name, e, self.dtype)
                     for e in range(experts.start, experts.stop)]
            data = torch.stack(parts).transpose(1, 2)
        else:
            full = tuple(slice(0, n) for n in self.hf_shape[1:])
            data = reader.read(self.name, (experts,) + full)
        return self._megatron(data)[(slice(None),) + rest].contiguous()

    def split(self, data: torch.Tensor) -> Dict[str, torch.Tensor]:
        t = data.reshape(self.shape)
        if self.gate_up:
            t = _interleave(t, 1)
        if self.weight:
            t = t.transpose(1, 2)
        return {self.name: t.contiguous()}


class OneExpert:
    """Expert `e` of a layer's fused expert weight `fused` (a FusedExperts with weight=True):
    megatron's [out, in] rows of that expert. `name` is a per-expert pseudo module weight
    (`model.layers.3.mlp.experts.1.gate_up_proj.weight`), one per expert so that each expert's
    adapter has its own name; `hf_rows` / `megatron_rows` reorder a [out, k] tensor (an adapter's
    B) between megatron's rows ([gate; up]) and transformers' out axis (interleaved)."""

    def __init__(self, fused: FusedExperts, e: int):
        if not fused.weight:
            raise ValueError(f"{fused.name}: a bias has no per-expert adapter rows")
        self.fused, self.expert = fused, e
        prefix, param = fused.name.rsplit(".", 1)
        self.name = f"{prefix}.{e}.{param}.weight"
        self.shape = tuple(fused.shape[1:])  # megatron [out, in]

    def hf_shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {self.name: self.shape}

    def hf_rows(self, t: torch.Tensor) -> torch.Tensor:
        """[out, k] in megatron's row order -> transformers' (gate and up interleaved)."""
        return _interleave(t, 0) if self.fused.gate_up else t

    def megatron_rows(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of hf_rows."""
        return _gate_up_rows(t, 0) if self.fused.gate_up else t


def mxfp4_names(name: str) -> Tuple[str, str]:
    return f"{name}_blocks", f"{name}_scales"


__all__ = ["FusedExperts", "OneExpert", "mxfp4_names"]
