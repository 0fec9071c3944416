"""Checkpoint entries of adapters: megatron dist_checkpointing ShardedTensors for the factors, and
state-dict keys that leave the wrapped base's checkpoint format untouched.

Two rules, shared by every adapter kind:
- The base layer's entries are exactly those of the unwrapped base: same ShardedTensor keys (a
  checkpoint of the plain model loads into the wrapped one, and back) and same local dict keys
  (`...linear_fc1.weight`, not `...linear_fc1.base_layer.weight`), because megatron's parents
  look entries up by dict key: MLP applies its gated-fc1 (swiglu) sharding to
  `linear_fc1.weight`, LanguageModule ties or pads `output_layer.weight`.
  `accept_unwrapped_keys` lets `load_state_dict` take those keys (and the `base_layer.` ones a
  plain `state_dict()` gives) for the wrapped module.
- Factors are ShardedTensors over the base's own group (the expert-TP group for experts), sharded
  on the axis they are held sharded on, replicated otherwise; offsets handed down by the parent
  (pipeline layer offsets, SequentialMLP's global expert axis) are kept, so a checkpoint saved at
  one TP/PP/EP/ETP layout loads at any other.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional

import torch


def with_dp_cp_group(metadata: Optional[dict]) -> dict:
    """metadata with `dp_cp_group` filled in (megatron's sharding helpers require it)."""
    from megatron.core import parallel_state

    metadata = dict(metadata or {})
    if metadata.get("dp_cp_group") is None:
        metadata["dp_cp_group"] = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return metadata


def factor_sharded_tensors(
    factors: Dict[str, torch.Tensor],
    prefix: str,
    axis: Dict[str, int],
    sharded_offsets,
    metadata: dict,
    group,
    strided: Iterable[str] = (),
) -> dict:
    """{prefix + name: ShardedTensor} for each factor.

    axis: name -> the dim the local tensor is a shard of (over `group`); absent: replicated.
    strided: names held with megatron's partition stride 2 on dim 0 (the B of a gated fc1:
        [gate_k; up_k] on rank k); saved through megatron's own swiglu factory so the global
        tensor is [gate; up] and reloads at any group size.
    """
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    out = make_sharded_tensors_for_checkpoint(
        dict(factors), prefix, axis, sharded_offsets,
        tp_group=group, dp_cp_group=metadata["dp_cp_group"],
    )
    singleton = bool(metadata.get("singleton_local_shards", False))
    for name in strided:
        key = f"{prefix}{name}"
        out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets, singleton)
    return out


def accept_unwrapped_keys(adapter: torch.nn.Module, base_attr: str = "base_layer") -> None:
    """Register a load_state_dict pre-hook on `adapter` that moves `prefix + X` to
    `prefix + base_attr + "." + X` for every X that is not one of the adapter's own parameters,
    buffers or children (module hooks, not parameter hooks: nothing touches gradients)."""

    def hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        own = set(module._parameters) | set(module._buffers) | set(module._modules)
        for key in [k for k in state_dict if k.startswith(prefix)]:
            head = key[len(prefix):].split(".", 1)[0]
            if head not in own:
                target = f"{prefix}{base_attr}.{key[len(prefix):]}"
                if target not in state_dict:
                    state_dict[target] = state_dict.pop(key)

    adapter._register_load_state_dict_pre_hook(hook, with_module=True)


def linear_factor_entries(geometry, factors: Dict[str, torch.Tensor], magnitude_name: str,
                          prefix: str, sharded_offsets, metadata: dict) -> dict:
    """The ShardedTensors of one linear's adapter tensors held as `geometry` says: column: B (and
    DoRA's magnitude) sharded on dim 0 with the base's stride, A replicated; row: A sharded on
    dim 1, B and the magnitude replicated; over the base's group (expert-TP for experts)."""
    column = geometry.mode == "column"
    axis = {"lora_B": 0} if column else {"lora_A": 1}
    if column and magnitude_name in factors:
        axis[magnitude_name] = 0
    strided = ({n for n in axis if n != "lora_A"} if column and geometry.stride > 1 else ())
    return factor_sharded_tensors(factors, prefix, axis, sharded_offsets, metadata,
                                  geometry.tp_group, strided=strided)


def stacked_expert_entry(entries: List, data: torch.Tensor):
    """One ShardedTensorFactory for a stacked expert tensor `data` [E_local, ...] whose experts'
    checkpoint entries are `entries` (ShardedTensors or factories, one per local expert, each
    laid out as a per-expert adapter's: the global-expert axis an offset handed down by the
    experts module): the saved tensors are exactly the per-expert ones, so checkpoints written
    with per-expert adapters load into stacked ones and back, at any layout.

    The build is a function of (key, data) only, as megatron's optimizer checkpointing needs
    (it rebuilds the factory with the optimizer state's key and tensor)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    key0 = entries[0].key
    if any(entry.key != key0 for entry in entries):
        raise NotImplementedError(
            f"stacked expert checkpoint entries need one key for every local expert, got "
            f"{sorted({entry.key for entry in entries})[:3]} (singleton_local_shards is not "
            "supported for expert adapters)")

    # An expert whose rank is below the stacked one (zero-padded) is saved without its padding.
    shapes = [tuple(entry.data.shape) for entry in entries]
    full = tuple(data.shape[1:])

    def build(key, tensor, replica_id, flattened_range):
        return {str(e): _rebuilt(entry, key, tensor[e][tuple(slice(0, n) for n in shape)])
                for e, (entry, shape) in enumerate(zip(entries, shapes))}

    def merge(loaded):
        out = []
        for e, (entry, shape) in enumerate(zip(entries, shapes)):
            t = _merged(entry, loaded[str(e)])
            if shape != full:
                t = torch.nn.functional.pad(t, [p for n, m in zip(reversed(shape), reversed(full))
                                                for p in (0, m - n)])
            out.append(t)
        return torch.stack(out)

    return ShardedTensorFactory(key0, data, build, merge, entries[0].replica_id)


def _rebuilt(entry, key: str, tensor: torch.Tensor):
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(entry, ShardedTensorFactory):
        return dataclasses.replace(entry, key=key, data=tensor).build()
    return dataclasses.replace(entry, key=key, data=tensor, dtype=tensor.dtype)


def _merged(entry, loaded):
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    return entry.merge_fn(loaded) if isinstance(entry, ShardedTensorFactory) else loaded


__all__ = ["accept_unwrapped_keys", "factor_sharded_tensors", "linear_factor_entries",
           "stacked_expert_entry", "with_dp_cp_group"]
