"""Load a base into a model built with deferred decoder linears, holding each linear in NF4 as
it is read: the rank never holds its full-precision decoder linears at once.

    with deferred_decoder_linears():                   # models/nf4_deferred.py
        model = build_model(info, config, use_te=False)
    load_nf4(model, info, hf=hf)                       # or directory=<torch_dist checkpoint>

1. Everything but the deferred linears' weights (embeddings, output layer, norms, routers,
   biases, and the linears' extra state) is loaded as convert/load.py loads a whole model:
   `load_hf` reads safetensors slices (local), `load_mcore` is one dist_checkpointing load
   (collective over the world: every rank makes the same single call).
2. Then each deferred linear in turn (named_modules order, the same on every rank of its group):
   this rank's shard of its global weight is read in the model's dtype (HF safetensors slices,
   or the torch_dist checkpoint's stored chunks through convert/dcp_read.py: local reads, no
   collective), quantised as its global matrix (models/nf4_model.quantize_linear_: gathered over
   the linear's TP or expert-TP group, that group's only collective) and dropped.

The values are those of `load_hf` / `load_mcore` then `quantize_base`: the same shard in the
same dtype reaches the same quantisation. Peak per rank: the packed linears, the tensors of
step 1, and one linear's transient (its shard, its global weight when gathered, the packed
global weight; for torch_dist, the one stored chunk convert/dcp_read.py caches).
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    apply_factory_merges,
)
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

from megatron_lora.convert.dcp_read import TorchDistCheckpoint
from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.hf_files import HFCheckpoint
from megatron_lora.convert.load import (
    model_sharded_state_dict,
    hf_sources,
    load_hf,
    load_mcore,
    read_hf,
)
from megatron_lora.families import ModelInfo
from megatron_lora.models.nf4_deferred import deferred_linears
from megatron_lora.models.nf4_model import check_targets, quantize_linear_
from megatron_lora.runtime.heap import release_free_heap


def _device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        if not p.is_meta:
            return p.device
    raise ValueError("load_nf4: every parameter of the model is deferred (meta)")


def _read_mcore(sharded_state_dict: dict, ckpt: TorchDistCheckpoint) -> dict:
    """read_hf's counterpart for a torch_dist checkpoint: these entries' local tensors, each in
    its model tensor's dtype, from the stored chunks their boxes overlap. Local: no collective."""
    sharded, _, factories = load_preprocess(sharded_state_dict)

    def fill(x):
        if isinstance(x, ShardedObject) or not isinstance(x, ShardedTensor):
            raise ConversionError(f"{x!r}: a deferred linear's weight is a sharded tensor")
        if x.flattened_range is not None:
            raise ConversionError(f"{x.key}: flattened shards are not supported")
        stored = ckpt.shape(x.key)
        if tuple(stored) != tuple(x.global_shape):
            raise ConversionError(
                f"{ckpt.directory}: {x.key} has global shape {list(stored)}, the model expects "
                f"{list(x.global_shape)}")
        sizes = (1,) * x.prepend_axis_num + tuple(x.local_shape)
        data = ckpt.read(x.key, x.global_offset, sizes)
        return data.reshape(x.local_shape).to(x.data.dtype)

    dict_list_map_inplace(fill, sharded)
    return apply_factory_merges(sharded, factories)


def load_nf4(model: torch.nn.Module, info: ModelInfo, *, hf: Optional[HFCheckpoint] = None,
             directory: Optional[str] = None) -> int:
    """Fill `model` (built in models.nf4_deferred.deferred_decoder_linears) from HF safetensors
    `hf` or the torch_dist checkpoint `directory` (exactly one), every decoder linear held in
    NF4 on the device of the model's other parameters; returns how many linears. Collective:
    call on every rank (see the module docstring for which collectives). Every linear is
    checked (NF4LayoutError) before the first collective."""
    if (hf is None) == (directory is None):
        raise ValueError("load_nf4: give hf or directory, not both or neither")
    targets = check_targets(model)
    deferred = {name for name, _ in deferred_linears(model)}
    loaded = [name for name, _ in targets if name not in deferred]
    if loaded or len(deferred) != len(targets):
        raise ValueError(
            "load_nf4: the model's decoder linears must all be deferred (built in "
            f"deferred_decoder_linears), and nothing else; not deferred: {loaded}, deferred "
            f"outside the decoder linears: {sorted(deferred - {n for n, _ in targets})}")
    keys = {f"{name}.weight": (name, linear) for name, linear in targets}
    sharded = model_sharded_state_dict(model)
    absent = [k for k in keys if k not in sharded]
    if absent:
        raise ConversionError(f"the model's sharded state dict has no {absent}")
    device = _device(model)
    if hf is not None:
        load_hf(model, info, hf, skip=keys)
        table = hf_sources(model, info)
        read = lambda entry: read_hf(entry, table, hf)  # noqa: E731
    else:
        ckpt = TorchDistCheckpoint(directory)  # local; a bad folder fails on every rank alike
        load_mcore(model, directory, skip=keys)
        read = lambda entry: _read_mcore(entry, ckpt)  # noqa: E731
    for key, (name, linear) in keys.items():
        weight = read({key: sharded[key]})[key]
        quantize_linear_(name, linear, weight.to(device))
        del weight
        release_free_heap()  # else the heap keeps each linear's transients resident
    return len(keys)


__all__ = ["load_nf4"]
