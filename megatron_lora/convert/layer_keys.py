"""Per-layer checkpoint keys: how megatron-core stores a model whose layers differ.

megatron-core's TransformerBlock stacks a homogeneous decoder's layer tensors on a leading layer
axis under one key (`decoder.layers.mlp.router.weight` [L, E, h]); as soon as the layers differ
(a `moe_layer_freq` list: dense layers between MoE layers) it keys every tensor by its global
layer instead, without that axis (`decoder.layers.3.mlp.router.weight` [E, h]), in 0.16 and 0.19
alike. `ModelShape.per_layer_keys` says which layout a model has.

The conversion mapping and the adapter table are written once, stacked; this module moves
between the two layouts:

- `unstack` turns stacked tensors into the per-layer ones megatron writes (for hf-to-mcore,
  `--load-hf`, mcore-to-hf and written adapter checkpoints);
- `stacked_key` maps one per-layer key and box back to the stacked key and box (the merged
  export's lookups);
- `StackedView` reads a per-layer checkpoint as if it were stacked (adapter checkpoints), with
  the layers each stacked key has, so a reader can check them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Sequence, Tuple

import torch

from megatron_lora.convert.errors import ConversionError

LAYERS = "decoder.layers."
_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def layer_key(key: str, layer: int) -> str:
    """`decoder.layers.mlp.router.weight`, 3 -> `decoder.layers.3.mlp.router.weight`."""
    return f"{LAYERS}{layer}.{key[len(LAYERS):]}"


def stacked_key(key: str, offsets: Sequence[int]) -> Tuple[str, Tuple[int, ...]]:
    """A per-layer key and box offsets -> the stacked key and offsets (layer axis first); other
    keys unchanged."""
    m = _PER_LAYER.match(key)
    if m is None:
        return key, tuple(offsets)
    return LAYERS + m.group(2), (int(m.group(1)),) + tuple(offsets)


def unstack_whole(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Whole stacked tensors by key -> one per layer (`decoder.layers.*` keys split on dim 0)."""
    out = {}
    for key, t in tensors.items():
        if key.startswith(LAYERS):
            out.update({layer_key(key, l): t[l] for l in range(t.shape[0])})
        else:
            out[key] = t
    return out


def unstack(tensors: list) -> list:
    """Stacked McoreTensors (`decoder.layers.*` with a leading layer axis) -> one McoreTensor per
    layer that has chunks, keyed by layer, without the layer axis; others unchanged."""
    out = []
    for t in tensors:
        if not t.key.startswith(LAYERS):
            out.append(t)
            continue
        by_layer: Dict[int, list] = {}
        for c in t.chunks:
            by_layer.setdefault(c.offsets[0], []).append(
                dataclasses.replace(c, offsets=c.offsets[1:], sizes=c.sizes[1:]))
        out += [dataclasses.replace(t, key=layer_key(t.key, l), shape=t.shape[1:],
                                    chunks=tuple(cs)) for l, cs in sorted(by_layer.items())]
    return out


class StackedView:
    """A per-layer checkpoint (convert.dcp_read.TorchDistCheckpoint) read through stacked keys:
    `tensors` has each stacked key once, `shape` is (num_layers,) + a layer's shape, and `read`
    of a box reads each of its layers' tensors. `layers[key]` lists the layers stored (a reader
    checks them: a layer missing from a box is an error of the per-layer read)."""

    def __init__(self, ckpt, num_layers: int):
        self.ckpt, self.directory, self.num_layers = ckpt, ckpt.directory, num_layers
        self.layers: Dict[str, List[int]] = {}
        self.tensors: Dict[str, str] = {}  # stacked key -> a per-layer key holding it
        for key in ckpt.tensors:
            m = _PER_LAYER.match(key)
            if m is None:
                self.tensors[key] = key
                continue
            stacked = LAYERS + m.group(2)
            self.layers.setdefault(stacked, []).append(int(m.group(1)))
            self.tensors.setdefault(stacked, key)
        for layers in self.layers.values():
            layers.sort()

    def _physical(self, key: str) -> str:
        if key not in self.tensors:
            raise ConversionError(f"{self.directory}: checkpoint has no tensor {key!r}")
        return self.tensors[key]

    def dtype(self, key: str) -> torch.dtype:
        return self.ckpt.dtype(self._physical(key))

    def shape(self, key: str) -> Tuple[int, ...]:
        one = self.ckpt.shape(self._physical(key))
        return (self.num_layers,) + one if key in self.layers else one

    def read(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        if key not in self.layers:
            return self.ckpt.read(self._physical(key), offsets, sizes)
        layers = range(offsets[0], offsets[0] + sizes[0])
        return torch.stack([self.ckpt.read(layer_key(key, l), offsets[1:], sizes[1:])
                            for l in layers])
