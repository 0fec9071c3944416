"""Load a model's HF weights into this rank's megatron-core model, at whatever layout it was built.

`load_mcore(model, directory)`: megatron's own `dist_checkpointing.load` of a torch_dist checkpoint
(collective over the world: every rank reads the boxes its shards cover), every file read as plain
data through `runtime.safe_load.dist_load`.

`load_hf(model, hf)`: straight from HF safetensors, no conversion step and no communication. Each
rank walks its model's sharded state dict (the same one `dist_checkpointing` uses, so the same
boxes of the same global tensors), and fills each local shard from the mapping table's chunks,
reading with safetensors slices only the rows/columns of the HF tensors that shard covers.

Both take `skip`, state-dict keys they leave out; `read_hf` reads any entries of the sharded state
dict without filling the model: convert/load_nf4.py loads the rest of a model with deferred
decoder linears that way, then reads and quantises its linears one by one.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    apply_factory_merges,
)
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.hf_files import HFCheckpoint
from megatron_lora.convert.mapping import mcore_tensors
from megatron_lora.convert.regions import assemble
from megatron_lora.families import ModelInfo
from megatron_lora.runtime.safe_load import CheckpointFileError, dist_load


def model_sharded_state_dict(model: torch.nn.Module):
    """This rank's sharded state dict of `model`: the boxes of the global tensors it holds."""
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    return model.sharded_state_dict(metadata=metadata)


def _apply(model: torch.nn.Module, state: dict, source: str, left_out=frozenset()) -> None:
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and k not in left_out]
    if missing or unexpected:
        raise ConversionError(
            f"{source} does not match the model: missing={missing}, unexpected={unexpected}")


def load_mcore(model: torch.nn.Module, directory: str, *, skip=frozenset()) -> None:
    """Load a torch_dist checkpoint saved at any layout (collective: call on every rank).
    skip: state-dict keys left out (neither read nor filled; convert/load_nf4.py reads them).

    A file that is not plain data raises ConversionError on every rank before any collective."""
    sharded = {k: v for k, v in model_sharded_state_dict(model).items() if k not in skip}
    try:
        state = dist_load(sharded, directory)
    except CheckpointFileError as exc:
        raise ConversionError(str(exc)) from None
    _apply(model, state, directory, skip)


def load_hf(model: torch.nn.Module, info: ModelInfo, hf: HFCheckpoint, *,
            skip=frozenset()) -> None:
    """Fill this rank's shards from HF safetensors (local: no collective). skip: as load_mcore's."""
    sharded = {k: v for k, v in model_sharded_state_dict(model).items() if k not in skip}
    _apply(model, read_hf(sharded, hf_sources(model, info), hf), hf.directory, skip)


def hf_sources(model: torch.nn.Module, info: ModelInfo) -> dict:
    """{checkpoint key: the mapping table's entry} for `model` (its dtype) of family `info`."""
    return {t.key: t for t in mcore_tensors(info, _model_dtype(model))}


def read_hf(sharded_state_dict: dict, table: dict, hf: HFCheckpoint) -> dict:
    """The state dict (local tensors, each in its model tensor's dtype) of these entries of a
    model's sharded state dict, read from HF safetensors (`table`: hf_sources): only the
    rows/columns each shard covers. Local: no collective."""
    sharded, _, factories = load_preprocess(sharded_state_dict)

    def fill(x):
        if isinstance(x, ShardedObject):
            return None  # local linears' _extra_state
        if not isinstance(x, ShardedTensor):
            return x
        t = table.get(x.key)
        if t is None:
            raise ConversionError(f"model tensor {x.key!r} has no HF source in the mapping table")
        if x.flattened_range is not None:
            raise ConversionError(f"{x.key}: flattened shards are not supported")
        if tuple(x.global_shape) != tuple(t.shape):
            raise ConversionError(
                f"{x.key}: model expects global shape {list(x.global_shape)}, the HF checkpoint "
                f"gives {list(t.shape)}")
        sizes = (1,) * x.prepend_axis_num + tuple(x.local_shape)
        chunks = [(c.offsets, c.sizes, _fetcher(c, hf)) for c in t.chunks]
        data = assemble(x.global_offset, sizes, chunks, x.data.dtype, x.key)
        return data.reshape(x.local_shape).to(x.data.dtype)

    dict_list_map_inplace(fill, sharded)
    return apply_factory_merges(sharded, factories)


def _fetcher(chunk, hf: HFCheckpoint):
    lead = len(chunk.sizes) - len(chunk.source.shape)

    def fetch(index):
        return chunk.source.read(hf, index[lead:])

    return fetch


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype
