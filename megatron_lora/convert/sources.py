"""Sources of the conversion mapping's chunks that are one HF tensor each (convert/mapping.py):
`Direct` (the tensor as it is) and `RopeRows` (its rope rows reordered: multi-latent attention
checkpoints whose rope channels are not interleaved, convert/mla_tensors.py).

A source says which HF tensors it covers (`hf_shapes`), reads a box of the megatron chunk from
an HF reader (`read(reader, index)`, index: slices over the chunk's own shape) and splits a whole
chunk back into HF tensors (`split`).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

Slices = Tuple[slice, ...]


class Direct:
    """A chunk that is one HF tensor as is."""

    def __init__(self, name: str, shape: Tuple[int, ...]):
        self.name, self.shape = name, tuple(shape)

    def hf_shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {self.name: self.shape}

    def read(self, reader, index: Slices) -> torch.Tensor:
        full = all(s.start == 0 and s.stop == n for s, n in zip(index, self.shape))
        return reader.read(self.name, None if full else index)

    def split(self, data: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {self.name: data.reshape(self.shape)}


class RopeRows:
    """An HF tensor [groups * (lead + r), cols] whose last r rows of each group are reordered
    on the megatron side (to_mcore order: models/mla.py rope_row_order). Reads the whole HF
    tensor (one attention projection) and slices the box."""

    def __init__(self, name: str, shape: Tuple[int, ...], groups: int, lead: int,
                 to_mcore: torch.Tensor, to_hf: torch.Tensor):
        self.name, self.shape = name, tuple(shape)
        self.groups, self.lead = groups, lead
        self.to_mcore, self.to_hf = to_mcore, to_hf

    def hf_shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {self.name: self.shape}

    def _rows(self, t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        w = t.reshape(self.groups, self.lead + len(order), -1)
        w = torch.cat([w[:, :self.lead], w[:, self.lead:][:, order]], dim=1)
        return w.reshape(t.shape)

    def read(self, reader, index) -> torch.Tensor:
        full = self._rows(reader.read(self.name, None), self.to_mcore)
        return full[tuple(index)].contiguous()

    def split(self, data: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {self.name: self._rows(data.reshape(self.shape), self.to_hf).contiguous()}
