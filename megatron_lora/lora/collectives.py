"""The LoRA path's collectives, as small autograd Functions over a given process group.

Every activation collective here moves a [tokens, r] tensor (r = LoRA rank), never a
hidden-sized one; the two weight gathers move one factor ([out, r] or [r, in]) and are used only
where the base layer's own input or output is replicated (gather_output / non-parallel input).
Shapes: activations are [s, b, r] (or [tokens, r]); "dim 0" is the sequence dimension, the one
megatron's sequence parallelism shards.

Each Function states its contract on one line, forward; backward. The process group is always
the base layer's own (see parallel.py); over a group of one rank every Function is the identity.
torch.distributed functions are looked up at call time (dist.all_reduce, ...) so that tools that
count collective traffic by wrapping them see these calls.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * _size(group),) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    size = _size(group)
    if x.shape[0] % size:
        raise ValueError(
            f"cannot reduce-scatter {x.shape[0]} rows (dim 0) over {size} ranks: the sequence "
            "length must be divisible by the tensor-parallel size under sequence parallelism"
        )
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


def _own_slice(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    size, rank = _size(group), _rank(group)
    part = x.shape[dim] // size
    return x.narrow(dim, rank * part, part).contiguous()


def _all_gather_along(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    # Gather along dim 0 (contiguous chunks), then move the chunks to `dim`.
    if dim == 0:
        return _all_gather_dim0(x, group)
    stacked = _all_gather_dim0(x.unsqueeze(0), group)  # [t, *x.shape]
    return torch.cat(stacked.unbind(0), dim=dim)


class _GradAllReduce(torch.autograd.Function):
    """forward: identity on [T, r]; backward: all-reduce the partial [T, r] gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _AllReduce(torch.autograd.Function):
    """forward: all-reduce partial sums [T, r]; backward: identity (the gradient is replicated)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherTokens(torch.autograd.Function):
    """forward: all-gather [T/t, r] -> [T, r] on dim 0; backward: reduce-scatter if the incoming
    gradient is a partial sum over the group, else keep this rank's [T/t, r] slice."""

    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group = group
        ctx.grad_is_partial = grad_is_partial
        return _all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return _reduce_scatter_dim0(grad, ctx.group), None, None
        return _own_slice(grad, ctx.group, 0), None, None


class _ReduceScatterTokens(torch.autograd.Function):
    """forward: reduce-scatter partial [T, r] -> complete [T/t, r] on dim 0; backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim0(grad, ctx.group), None


class _GatherWeight(torch.autograd.Function):
    """forward: all-gather a factor shard along `dim`; backward: keep this rank's slice of the
    full gradient, which every rank holds identically."""

    @staticmethod
    def forward(ctx, w, group, dim):
        ctx.group = group
        ctx.dim = dim
        return _all_gather_along(w, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.group, ctx.dim), None, None


class _GradSum(torch.autograd.Function):
    """forward: identity on a replicated factor; backward: all-reduce its partial gradient."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


def grad_sum(w: torch.Tensor, group) -> torch.Tensor:
    """A replicated factor used where each rank's gradient is a partial sum over `group` (expert
    linears under expert-TP: the dispatcher, not the layer, reduces the activations). Returns w;
    the gradient reaching w is summed over `group` inside autograd, once per forward, so neither
    parameter hooks nor finalize_model_grads (which knows only the dense TP group) are needed.
    One all-reduce of a factor-sized ([r, in] or [out, r]) tensor, no token-sized traffic."""
    return w if _size(group) == 1 else _GradSum.apply(w, group)


def grad_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """[T, r] -> [T, r] unchanged; its gradient is all-reduced over `group` in backward."""
    return x if _size(group) == 1 else _GradAllReduce.apply(x, group)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Partial sums [T, r] (one per rank) -> their sum [T, r], replicated."""
    return x if _size(group) == 1 else _AllReduce.apply(x, group)


def gather_tokens(x: torch.Tensor, group, grad_is_partial: bool) -> torch.Tensor:
    """This rank's sequence shard [s/t, b, r] -> the whole sequence [s, b, r]."""
    return x if _size(group) == 1 else _GatherTokens.apply(x, group, grad_is_partial)


def reduce_scatter_tokens(x: torch.Tensor, group) -> torch.Tensor:
    """Partial sums [s, b, r] -> this rank's sequence shard of their sum [s/t, b, r]."""
    return x if _size(group) == 1 else _ReduceScatterTokens.apply(x, group)


def gather_weight(w: torch.Tensor, group, dim: int) -> torch.Tensor:
    """A factor sharded on `dim` -> the global factor (a weight, not an activation)."""
    return w if _size(group) == 1 else _GatherWeight.apply(w, group, dim)


__all__ = [
    "all_reduce",
    "gather_tokens",
    "gather_weight",
    "grad_all_reduce",
    "grad_sum",
    "reduce_scatter_tokens",
]
