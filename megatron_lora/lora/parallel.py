"""How a base linear is split over tensor-parallel ranks, read from the layer itself.

`describe_base_layer(base)` returns a `LinearGeometry`: column or row parallel, the global sizes,
the process group the layer communicates in (taken from the layer, never from the global parallel
state: expert linears use the expert-tensor-parallel group, not the dense TP group) and the flags
that decide the parallel state of its input and output.

Two kinds of layer are recognised, by attributes rather than class names:
- anything with a `parallel_mode` attribute of "column" or "row" (Transformer Engine linears and
  megatron's TE wrappers): sizes from `in_features`/`out_features`, group from `tp_group`;
- megatron-core's ColumnParallelLinear / RowParallelLinear (isinstance, subclasses included).

Everything is decided from Python attributes the rank already holds, so an unsupported layer
raises the same error on every rank before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import torch
import torch.distributed as dist

COLUMN = "column"
ROW = "row"


class UnsupportedBaseLayerError(TypeError):
    """LoraAdapter was given a base_layer it cannot wrap exactly; the message says why."""


@dataclass(frozen=True)
class LinearGeometry:
    """The parallel layout of a base linear Y = X W^T (+ b), W global [out_features, in_features].

    mode: "column" (W sharded on dim 0: each rank holds [out/t, in]) or
          "row" (W sharded on dim 1: each rank holds [out, in/t]).
    tp_group / tp_size / tp_rank: the group the base layer communicates in and this rank's place.
    sequence_parallel: column: input [s/t, b, in] is this rank's sequence shard (the base gathers
        it); row: output [s/t, b, out] is reduce-scattered along the sequence.
    gather_output: column only: the output is all-gathered to [s, b, out] (replicated).
    input_is_parallel: row only: the input is [s, b, in/t] (sharded on the last dim); when False
        the input is [s, b, in], replicated, and the base slices it itself.
    dispatcher_reduces: an expert linear with explicit expert communication (megatron's
        `explicit_expert_comm`: is_expert with expert-TP or EP > 1). Its input [tokens, in] is the
        same on every rank of the (expert-TP) group, the column input gradient and the row output
        are left as partial sums over the group, and the token dispatcher reduces them (its
        backward all-gather / forward reduce-scatter). No SP inside such a layer.
    is_expert: the base is an expert linear: its parameters belong to the expert-data-parallel
        gradient buffers (megatron's `allreduce = False`), whatever the EP size.
    stride: column only: megatron's partition stride of W's dim 0. Rank k holds the chunks
        k, k + t, k + 2t, ... of size out / (t * stride) (2 for a gated fc1: [gate_k; up_k]).
    weight_at_forward: the base allocates no weight and is handed one at forward (the output
        layer of a model with tied embeddings); merge is impossible.
    """

    mode: str
    in_features: int
    out_features: int
    tp_group: Optional[Any]
    tp_size: int
    tp_rank: int
    sequence_parallel: bool
    gather_output: bool = False
    input_is_parallel: bool = True
    dispatcher_reduces: bool = False
    is_expert: bool = False
    stride: int = 1
    weight_at_forward: bool = False

    @property
    def in_local(self) -> int:
        return self.in_features // self.tp_size if self.mode == ROW else self.in_features

    @property
    def out_local(self) -> int:
        return self.out_features // self.tp_size if self.mode == COLUMN else self.out_features

    def describe(self) -> str:
        flags = [f"tp={self.tp_size}"]
        if self.sequence_parallel:
            flags.append("sp")
        if self.mode == COLUMN and self.gather_output:
            flags.append("gather_output")
        if self.mode == ROW and not self.input_is_parallel:
            flags.append("input_not_parallel")
        if self.dispatcher_reduces:
            flags.append("expert_comm")
        if self.stride != 1:
            flags.append(f"stride={self.stride}")
        return f"{self.mode}({self.in_features}->{self.out_features}, {', '.join(flags)})"


def _group_size_rank(group) -> tuple:
    # Reading a group's size and this rank's place is local bookkeeping, not communication.
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _reject_partial_input_grad(base: torch.nn.Module) -> None:
    """ColumnParallelLinear(disable_grad_reduce=True) hands back an input gradient that is a
    partial sum for an unknown party to reduce; the adapter cannot know how, so it is refused.
    (Expert linears with explicit expert communication are supported: their partial sums are
    reduced by the token dispatcher, which the adapter relies on; see `dispatcher_reduces`.)"""
    if getattr(base, "disable_grad_reduce", False) and not getattr(
        base, "explicit_expert_comm", False
    ):
        raise UnsupportedBaseLayerError(
            f"base_layer {type(base).__name__} has disable_grad_reduce=True (input gradient left "
            "as a partial sum); LoraAdapter needs the base to reduce its input gradient"
        )


def _expert_flags(base: torch.nn.Module) -> dict:
    explicit = bool(getattr(base, "explicit_expert_comm", False))
    return dict(
        dispatcher_reduces=explicit,
        is_expert=explicit or bool(getattr(base, "is_expert", False)),
    )


def base_weight_meta(layer):
    """What an adapter reads of its base's weight (dtype, device, the parallel attributes such
    as `allreduce`) without reading an NF4 base's `weight`, which dequantises the whole matrix
    (models/nf4_linear.py): that base answers from its codes' device and stored dtype. Other
    bases: their weight itself (None for a tied output layer)."""
    if not getattr(layer, "nf4", False):
        return getattr(layer, "weight", None)
    return SimpleNamespace(dtype=layer.nf4_dtype, device=layer.nf4_codes.device,
                           **layer.nf4_weight_attributes)


def _stride(base: torch.nn.Module) -> int:
    weight = base_weight_meta(base)
    stride = int(getattr(weight, "partition_stride", 1) or 1) if weight is not None else 1
    return max(stride, 1)


def _from_parallel_mode(base: torch.nn.Module, mode_attr: Any) -> LinearGeometry:
    mode = str(mode_attr).lower() if mode_attr is not None else None
    if mode not in (COLUMN, ROW):
        raise UnsupportedBaseLayerError(
            f"base_layer {type(base).__name__} has parallel_mode={mode_attr!r}; only 'column' "
            "and 'row' parallel linears are supported"
        )
    if hasattr(base, "layer_norm_weight") or getattr(base, "return_layernorm_output", False):
        # A LayerNorm-fused linear normalises its input internally: LoRA must see the normalised
        # activations, which the layer does not hand out here.
        raise UnsupportedBaseLayerError(
            f"base_layer {type(base).__name__} fuses a LayerNorm into the linear; the LoRA input "
            "must be the normalised activations, which this layer does not expose"
        )
    _reject_partial_input_grad(base)
    for name in ("in_features", "out_features"):
        if not isinstance(getattr(base, name, None), int):
            raise UnsupportedBaseLayerError(
                f"base_layer {type(base).__name__} has parallel_mode={mode!r} but no integer "
                f"`{name}` attribute"
            )
    group = getattr(base, "tp_group", None)
    size, rank = _group_size_rank(group)
    flags = _expert_flags(base)
    return LinearGeometry(
        mode=mode,
        in_features=base.in_features,
        out_features=base.out_features,
        tp_group=group,
        tp_size=size,
        tp_rank=rank,
        sequence_parallel=(
            bool(getattr(base, "sequence_parallel", False)) and size > 1
            and not flags["dispatcher_reduces"]
        ),
        gather_output=False,  # TE column linears never gather their output
        input_is_parallel=True,  # TE row linears always take a sharded input
        stride=_stride(base) if mode == COLUMN else 1,
        **flags,
    )


def describe_base_layer(base: torch.nn.Module) -> LinearGeometry:
    """The geometry of `base`; raises UnsupportedBaseLayerError naming base_layer otherwise."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if not isinstance(base, torch.nn.Module):
        raise UnsupportedBaseLayerError(
            f"base_layer must be a torch.nn.Module parallel linear, got {type(base).__name__}"
        )
    if hasattr(base, "parallel_mode"):
        return _from_parallel_mode(base, base.parallel_mode)
    if isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
        _reject_partial_input_grad(base)
        column = isinstance(base, ColumnParallelLinear)
        weight = base_weight_meta(base)
        if weight is None and not column:
            raise UnsupportedBaseLayerError(
                f"base_layer {type(base).__name__} allocates no weight; LoraAdapter needs one"
            )
        group = base.tp_group
        size, rank = _group_size_rank(group)
        flags = _expert_flags(base)
        return LinearGeometry(
            mode=COLUMN if column else ROW,
            in_features=base.input_size,
            out_features=base.output_size,
            tp_group=group,
            tp_size=size,
            tp_rank=rank,
            # megatron's column layer switches SP off at TP=1; its row layer keeps the flag (its
            # reduce-scatter over one rank is the identity): either way nothing is sharded at t=1.
            # Expert linears run without SP whatever the config says (megatron passes
            # sequence_parallel=False for explicit expert communication).
            sequence_parallel=(
                bool(base.sequence_parallel) and size > 1 and not flags["dispatcher_reduces"]
            ),
            gather_output=bool(base.gather_output) if column else False,
            input_is_parallel=True if column else bool(base.input_is_parallel),
            stride=_stride(base) if column else 1,
            # A column layer without its own weight (tied output layer) gets one at forward.
            weight_at_forward=column and weight is None,
            **flags,
        )
    raise UnsupportedBaseLayerError(
        f"base_layer of type {type(base).__name__} is not supported: expected megatron-core's "
        "ColumnParallelLinear / RowParallelLinear or a linear with parallel_mode 'column'/'row'"
    )
