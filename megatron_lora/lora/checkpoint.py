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

from typing import Dict, Iterable, Optional

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


__all__ = ["accept_unwrapped_keys", "factor_sharded_tensors", "with_dp_cp_group"]
