"""Base torch_dist checkpoint + adapter checkpoint -> merged Hugging Face safetensors, streamed.

    export_merged_hf("mixtral-mcore", "runs/lora", "Mixtral-merged")

The walk is mcore-to-hf's (`convert.mcore_to_hf`): chunks of the mapping table in HF order, each
box read from the base checkpoint at whatever layout it was saved, split into HF tensors and
appended to the current shard. A box of a weight that carries an adapter gets, before the split,
W + scale * B[rows] A (the rows of B that box covers; the embedding: rows of (scale * B A)^T),
computed in fp32 and cast back to the base dtype. One box and one adapter's factors are in memory
at a time; a layer's fused experts (GPT-OSS: one box [E, 2f, h] for `gate_up_proj`) get each
expert's update in megatron's rows before the split interleaves them. Tied embeddings with an
embedding or output-layer adapter are refused (merging one would change the other), and so are
prefix-tuning adapters (no weight to merge into; `export peft`). DoRA adapters (use_dora): each
row of W + scale * B A is then scaled by m / ||that row|| (lora/dora.py; a box holds whole rows,
so the norms are the box's own).
"""

from __future__ import annotations

from typing import Tuple

import torch

from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.fused_experts import FusedExperts
from megatron_lora.convert.hf_to_mcore import read_mcore_info
from megatron_lora.convert.layer_keys import stacked_key
from megatron_lora.convert.mcore_to_hf import DEFAULT_SHARD_BYTES, mcore_to_hf
from megatron_lora.convert.outputs import prepare_output_dir
from megatron_lora.export.adapter_ckpt import AdapterCheckpoint
from megatron_lora.export.table import sites


class _Merger:
    """W + delta for boxes of adapted weights; caches the last adapter's fp32 factors."""

    def __init__(self, adapter: AdapterCheckpoint, info):
        self.adapter = adapter
        self.by_base = {k.base_key: k for k in adapter.kinds()}
        self.sites = {(k.name, s.index): s for k in adapter.kinds() for s in sites(info, k)}
        self._cached: Tuple[object, tuple] = (None, ())

    def _factors(self, site):
        if self._cached[0] is not site:
            a, b = self.adapter.factors(site)
            _, _, scale = self.adapter.scaling(site)
            m = self.adapter.magnitude(site).float() if self.adapter.config.use_dora else None
            self._cached = (site, (a.float(), b.float(), scale, m))
        return self._cached[1]

    def apply(self, key: str, chunk, box: torch.Tensor) -> torch.Tensor:
        key, offsets = stacked_key(key, chunk.offsets)  # the table's stacked key and box
        kind = self.by_base.get(key)
        if kind is None:
            return box
        if isinstance(chunk.source, FusedExperts):  # a layer's experts, [E, out, in]
            return torch.stack([self._merge(kind, (offsets[0], offsets[1] + e), 0, one)
                                for e, one in enumerate(box)])
        return self._merge(kind, offsets[:kind.lead], offsets[kind.lead], box)

    def _merge(self, kind, index, row0: int, box: torch.Tensor) -> torch.Tensor:
        """box (rows row0.. of the weight of `kind`'s adapter at `index`) + its update."""
        a, b, scale, m = self._factors(self.sites[(kind.name, tuple(index))])
        rows = box.shape[0]
        if kind.name == "embedding":  # rows of (B A)^T: [rows, h]
            delta = (b @ a[:, row0:row0 + rows]).t()
        else:
            delta = b[row0:row0 + rows] @ a
        merged = box.float().reshape(delta.shape) + delta.mul_(scale)
        if m is not None:  # DoRA: rows scaled by m / ||W + scale B A||_row
            merged = merged * (m[row0:row0 + rows] / torch.linalg.norm(merged, dim=1)).unsqueeze(1)
        return merged.reshape(box.shape).to(box.dtype)


def export_merged_hf(load: str, adapter: str, save: str, *, hf_config: str = None,
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                     progress: bool = True, allow_other_base: bool = False) -> None:
    """Write the merged model as HF safetensors shards + index + config.json at `save`
    (allow_other_base: merge an adapter recorded as trained on another base, lora/adapter_base)."""
    prepare_output_dir(save, overwrite=overwrite,
                       inputs={"--load": load, "--adapter": adapter, "--hf-config": hf_config})
    info = read_mcore_info(load, hf_config)
    merger = _Merger(AdapterCheckpoint(adapter, info, allow_other_base), info)
    if merger.adapter.config.num_virtual_tokens:
        raise ConversionError(
            f"{adapter}: a prefix-tuning adapter (--peft-type prefix, num_virtual_tokens="
            f"{merger.adapter.config.num_virtual_tokens}) adds keys and values every layer "
            f"attends to; it cannot be merged into the weights. Export it with `export peft` "
            f"(PEFT's PREFIX_TUNING) instead")
    if merger.adapter.config.trainable_token_indices:
        raise ConversionError(
            f"{adapter}: the adapter trains new tokens (--add-special-tokens, ids "
            f"{list(merger.adapter.config.trainable_token_indices)}); the merged export does not "
            f"write them (it keeps the base vocabulary). Export it with `export peft` (PEFT's "
            f"trainable_token_indices) instead")
    if info.shape.tie_embeddings and {"embedding", "output_layer"} & set(merger.adapter.ranks):
        raise ConversionError(f"{adapter}: an embedding or output-layer adapter cannot be merged "
                              f"into a model with tied embeddings")
    mcore_to_hf(load, save, hf_config=hf_config, max_shard_bytes=max_shard_bytes,
                overwrite=overwrite, progress=progress, transform=merger.apply, label="merge")
