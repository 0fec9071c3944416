"""Reference weights: build a model once, save its global weights, load them at any layout.

The checkpoint is a megatron-core distributed checkpoint (torch_dist format), so the same global
tensors load at any TP/PP/EP/ETP layout: every later parity test compares layouts that start from
bit-identical global weights. Loading reads every file as plain data (`runtime.safe_load`).
"""

from __future__ import annotations

import os

import torch
from megatron.core import dist_checkpointing, parallel_state

from megatron_lora.runtime.safe_load import dist_load


def _sharded_state_dict(model: torch.nn.Module):
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    return model.sharded_state_dict(metadata=metadata)


def save_weights(model: torch.nn.Module, directory: str) -> None:
    """Save `model`'s (this layout's shards of the) global weights to `directory` (collective)."""
    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(_sharded_state_dict(model), directory)


def load_weights(model: torch.nn.Module, directory: str) -> None:
    """Load global weights saved by save_weights (at any layout) into `model` (collective)."""
    state = dist_load(_sharded_state_dict(model), directory)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(
            f"checkpoint {directory} does not match the model: missing={missing}, "
            f"unexpected={unexpected}"
        )
