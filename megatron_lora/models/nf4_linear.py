"""A frozen megatron column/row-parallel linear held in NF4 (models/nf4.py), dequantised per GEMM.

    to_nf4_(linear, shard)     # linear: ColumnParallelLinear / RowParallelLinear, in place

The layer keeps its class's behaviour (it becomes an `NF4ColumnParallelLinear` /
`NF4RowParallelLinear`, subclasses of megatron's, so `isinstance`, `tp_group`, the SP / expert
flags and the sharded-state-dict keys are unchanged) but its `weight` Parameter is replaced by
uint8 buffers (codes, block scales) and two small fp32 ones (the second-level scales). Each
forward dequantises the weight into the input's dtype inside `_NF4MatMul`, an autograd Function
that keeps no dequantised copy for backward: backward dequantises again for the input gradient
(a frozen base has no weight gradient). On CUDA the dequantisation is bitsandbytes' kernel, on
CPU plain torch (models/nf4.py dequantize_parts). Grouped experts (`grouped_nf4`) dequantise
one expert at a time (on CUDA into one buffer reused by every expert) and run that expert's rows'
GEMM from it, in forward and again in backward: never a stack of all experts' weights. The
collectives around the GEMM are megatron's own mappings, chosen exactly as
ColumnParallelLinear.forward / RowParallelLinear.forward choose them (SP all-gather with a
reduce-scatter backward, the TP all-reduce of the input gradient, the row output's reduce or
reduce-scatter, nothing for experts with explicit expert communication).

`linear.weight` still answers, as a fresh dequantised tensor in the compute dtype (with the old
Parameter's parallel attributes), for code outside the training path; it dequantises the whole
weight on every read, so the hot paths never read it: LoRA takes the dtype, device and parallel
attributes from `nf4_dtype`, the codes and `nf4_weight_attributes` (lora/dora.py
base_weight_meta), DoRA asks `dequantized_weight()` explicitly. It is not a Parameter, so
writing into it changes nothing: merging onto an NF4 base is refused (lora/merge.py). The
buffers are not persistent: checkpoints of the model hold what they held before minus the base
weight, which is re-quantised from the base on load.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)

from megatron_lora.models.nf4 import NF4Shard, dequantize_parts

_BUFFERS = ("nf4_codes", "nf4_qabsmax", "nf4_scale2", "nf4_offsets")
_KEPT_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "allreduce",
                    "sequence_parallel", "shared")


def dequantized(module, dtype: torch.dtype, out=None) -> torch.Tensor:
    """The module's local weight [out_local, in_local] in dtype, on its buffers' device (a new
    tensor, or written into `out`, a contiguous tensor of that shape and dtype)."""
    return dequantize_parts(module.nf4_codes, module.nf4_qabsmax, module.nf4_scale2,
                            module.nf4_offsets, module.nf4_layout, dtype, out=out)


class _NF4MatMul(torch.autograd.Function):
    """y = x W^T with W dequantised from `module`'s buffers in forward and again in backward."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        w = dequantized(module, x.dtype)
        return torch.matmul(x, w.t())

    @staticmethod
    def backward(ctx, grad):
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(grad, dequantized(ctx.module, grad.dtype))
        return grad_x, None


class _GroupedNF4(torch.autograd.Function):
    """Grouped x_e W_e^T over the token split `counts`, one expert at a time: W_e dequantised
    (into one [out, in] buffer reused by every expert of the call) and its rows' GEMM run from
    it, in forward and again in backward; no dequantised weight is kept in between, and no
    stack of the experts' weights is ever built. Experts without rows are not dequantised."""

    @staticmethod
    def forward(ctx, x, counts, modules):
        ctx.counts, ctx.modules = counts, modules
        return _per_expert(x, counts, modules, transpose=True)

    @staticmethod
    def backward(ctx, grad):
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _per_expert(grad.contiguous(), ctx.counts, ctx.modules, transpose=False)
        return grad_x, None, None


def _per_expert(x: torch.Tensor, counts, modules, transpose: bool) -> torch.Tensor:
    """Rows of group e times W_e^T (transpose) or W_e: x [N, K] -> [N, M]. The products are
    grouped_mm's loop's (the same matmul of the same operands), so the values are too."""
    out, buffer, start = None, None, 0
    for module, n in zip(modules, counts):
        if n:
            # CUDA: bitsandbytes writes each expert into the same buffer (the matmuls run in
            # stream order); CPU: a fresh tensor each (copying into a buffer would cost a copy).
            buffer = dequantized(module, x.dtype, out=buffer if x.is_cuda else None)
            w = buffer.t() if transpose else buffer
            if out is None:
                out = x.new_empty((x.shape[0], w.shape[1]))
            torch.matmul(x[start:start + n], w, out=out[start:start + n])
        start += n
    if out is None:  # no rows at all
        rows, cols = modules[0].nf4_codes.shape
        out = x.new_empty((x.shape[0], rows if transpose else cols * 2))
    return out


def grouped_nf4(x: torch.Tensor, counts, modules) -> torch.Tensor:
    """x [N, in] split by counts (one group per module, in order) -> [N, out]."""
    return _GroupedNF4.apply(x, list(counts), list(modules))


def nf4_matmul(x: torch.Tensor, module) -> torch.Tensor:
    """x [..., in_local] @ W^T -> [..., out_local], W the NF4 weight of module."""
    return _NF4MatMul.apply(x, module)


class _NF4Weight:
    """The `weight` of an NF4 layer: a dequantised copy on every read (see the module docstring)."""

    def __get__(self, module, owner=None):
        if module is None:
            return self
        w = dequantized(module, module.nf4_dtype)
        for name, value in module.nf4_weight_attributes.items():
            setattr(w, name, value)
        return w


def _dequantized_weight(module, dtype=None) -> torch.Tensor:
    """The local weight [out_local, in_local] dequantised in dtype (default: the stored
    nf4_dtype); the same tensor the `weight` read gives, asked for explicitly."""
    return dequantized(module, module.nf4_dtype if dtype is None else dtype)


class NF4ColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear with an NF4 weight (made by to_nf4_, never constructed directly)."""

    weight = _NF4Weight()
    nf4 = True
    dequantized_weight = _dequantized_weight

    def forward(self, input_, weight=None, runtime_gather_output=None):
        if weight is not None:
            raise RuntimeError("an NF4 column-parallel linear computes with its own weight")
        if self.explicit_expert_comm or self.disable_grad_reduce:
            x = input_  # the token dispatcher (experts) reduces the input gradient
        elif self.sequence_parallel:
            x = gather_from_sequence_parallel_region(input_, True, group=self.tp_group)
        else:
            x = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        out = nf4_matmul(x, self)
        if self.bias is not None and not self.skip_bias_add:
            out = out + self.bias
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)


class NF4RowParallelLinear(RowParallelLinear):
    """RowParallelLinear with an NF4 weight (made by to_nf4_, never constructed directly)."""

    weight = _NF4Weight()
    nf4 = True
    dequantized_weight = _dequantized_weight

    def forward(self, input_):
        if self.input_is_parallel:
            x = input_
        else:
            x = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        out = nf4_matmul(x, self)
        if self.explicit_expert_comm:
            pass  # a partial sum over expert-TP: the token dispatcher reduces it
        elif self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
        else:
            out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None


def is_nf4(module) -> bool:
    return isinstance(module, (NF4ColumnParallelLinear, NF4RowParallelLinear))


def to_nf4_(linear: torch.nn.Module, shard: NF4Shard, device=None) -> None:
    """Replace linear's weight Parameter by `shard` (its local part, any device), in place.
    device: where the buffers go (default: the old weight's; give it for a meta weight,
    models/nf4_deferred.py)."""
    if is_nf4(linear):
        raise ValueError("the linear is already held in NF4")
    if isinstance(linear, ColumnParallelLinear):
        cls = NF4ColumnParallelLinear
    elif isinstance(linear, RowParallelLinear):
        cls = NF4RowParallelLinear
    else:
        raise TypeError(f"NF4 holds megatron-core Column/RowParallelLinear weights, not "
                        f"{type(linear).__name__}")
    if type(linear) not in (ColumnParallelLinear, RowParallelLinear):
        raise TypeError(f"NF4 replaces the forward of megatron-core's own linears; "
                        f"{type(linear).__name__} has its own")
    old = linear.weight
    if tuple(shard.shape) != tuple(old.shape):
        raise ValueError(f"NF4 shard {list(shard.shape)} does not fit the weight "
                         f"{list(old.shape)}")
    shard = shard.to(old.device if device is None else device)
    attributes = {n: getattr(old, n) for n in _KEPT_ATTRIBUTES if hasattr(old, n)}
    del linear._parameters["weight"]
    linear.__class__ = cls
    for name, value in zip(_BUFFERS, (shard.codes, shard.qabsmax, shard.scale2, shard.offsets)):
        linear.register_buffer(name, value, persistent=False)
    linear.nf4_layout = shard.layout
    linear.nf4_dtype = old.dtype
    linear.nf4_weight_attributes = attributes


def held_bytes(module) -> int:
    """Bytes of the NF4 buffers of one layer (the code books, shared by all, not counted)."""
    return sum(getattr(module, n).nbytes for n in _BUFFERS)


__all__ = ["NF4ColumnParallelLinear", "NF4RowParallelLinear", "dequantized", "grouped_nf4",
           "held_bytes", "is_nf4", "nf4_matmul", "to_nf4_"]
