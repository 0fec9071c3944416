"""Grouped matmuls over the local experts' row splits, and the LoRA factor product built on them.

    splits = Splits(tokens_per_expert_list, device, counts_tensor)   # once per MoE layer call
    y = grouped_mm(x, w, splits)                 # x [N, K] split by expert, w [E, K, M] -> [N, M]
    u = grouped_linear(x, a, splits, scale, p, keys, feature_offset, token_ids)   # [N, r]

x [N, K] holds the dispatcher's permuted rows, expert by expert (counts[e] rows for local expert
e, zeros allowed). `torch._grouped_mm` runs the products on CUDA where it accepts the operands
(16-byte aligned strides, bf16 on recent GPUs), with the int32 end offsets of the splits built
once per layer call on the device (`Splits.offsets`: from the dispatcher's count tensor where it
is already on the device, else one host-to-device copy; never a host read). Otherwise, and always
on CPU, a loop over the splits computes the same products (the exact CPU path). No [E, in, out]
delta weight is ever built. The expert adapters (lora/expert_lora.py) and the grouped experts
(models/grouped_experts.py) share these.

Dropout (training, p > 0) in grouped_linear masks row n of group e with keep_mask_at(keys[e], p,
token_ids[n], features): the masks of lora/dropout.py, layout-independent.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

import torch

from megatron_lora.lora.dropout import keep_mask_at


class Splits:
    """Rows split over consecutive local experts: `counts` (host ints, for the CPU loop and the
    shapes) and their int32 end offsets on the rows' device, built on first use and shared by
    every grouped matmul of the layer call (forward and backward).

    counts: rows per expert; device: the rows' device; counts_tensor: the same counts as a
    tensor (the dispatcher's tokens_per_expert), used for the offsets when it is on `device`."""

    def __init__(self, counts: Sequence[int], device, counts_tensor: Optional[torch.Tensor] = None):
        self.counts: List[int] = [int(c) for c in counts]
        self.device = torch.device(device)
        self._tensor = counts_tensor
        self._offsets: Optional[torch.Tensor] = None

    def __len__(self) -> int:
        return len(self.counts)

    def __iter__(self):
        return iter(self.counts)

    def offsets(self) -> torch.Tensor:
        """int32 [E] cumulative row counts on the rows' device."""
        if self._offsets is None:
            t = self._tensor
            if t is None or t.device != self.device:
                t = torch.tensor(self.counts, dtype=torch.int64, device=self.device)
            self._offsets = torch.cumsum(t, 0).to(torch.int32)
        return self._offsets

    def part(self, e0: int, e1: int) -> "Splits":
        """The splits of experts e0 .. e1 - 1 (rows counted from their first)."""
        if e0 == 0 and e1 == len(self.counts):
            return self
        return Splits(self.counts[e0:e1], self.device)


CountsLike = Union[Splits, Sequence[int]]


def as_splits(counts: CountsLike, device) -> Splits:
    return counts if isinstance(counts, Splits) else Splits(counts, device)


def _grouped_kernel(x: torch.Tensor) -> bool:
    """Whether to try torch._grouped_mm: on CUDA. On CPU it is no faster than the loop for large
    groups and several times slower for the LoRA factors' thin products ([N, h] x [h, r]: 0.66 s
    against 0.09 s for 64 groups of 512 x 1024 x 16, measured here), so the loop is used."""
    return x.is_cuda and x.shape[0] > 0 and hasattr(torch, "_grouped_mm")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: CountsLike) -> torch.Tensor:
    """Grouped x_e @ w_e: x [N, K] split by counts, w [E, K, M] -> [N, M]."""
    splits = as_splits(counts, x.device)
    if _grouped_kernel(x):
        try:
            return torch._grouped_mm(x, w, offs=splits.offsets())
        except RuntimeError:
            pass  # operands it does not take (alignment, dtype): the loop below is exact
    out = x.new_empty((x.shape[0], w.shape[2]))
    start = 0
    for e, n in enumerate(splits.counts):
        if n:
            torch.matmul(x[start:start + n], w[e], out=out[start:start + n])
        start += n
    return out


def grouped_mm_wgrad(x: torch.Tensor, g: torch.Tensor, counts: CountsLike,
                     num: int) -> torch.Tensor:
    """Per-group x_e^T @ g_e: x [N, K], g [N, M] -> [E, K, M] (zeros for empty groups)."""
    splits = as_splits(counts, x.device)
    if _grouped_kernel(x):
        try:
            out = torch._grouped_mm(x.t(), g, offs=splits.offsets())
        except RuntimeError:
            pass
        else:
            empty = [e for e, n in enumerate(splits.counts) if n == 0]
            if empty:  # the kernel leaves an empty group's block unwritten: its gradient is 0
                out.index_fill_(0, torch.tensor(empty, device=out.device), 0)
            return out
    out = x.new_zeros((num, x.shape[1], g.shape[1]))
    start = 0
    for e, n in enumerate(splits.counts):
        if n:
            torch.matmul(x[start:start + n].t(), g[start:start + n], out=out[e])
        start += n
    return out


class _GroupedLinear(torch.autograd.Function):
    """forward: y_e = s * drop(x_e) @ w_e^T for w [E, M, K]; backward: grads of x and w, the
    dropout mask regenerated from its keys (nothing but x, w and the row indices kept)."""

    @staticmethod
    def forward(ctx, x, w, counts, scale, p, keys, feature_offset, token_ids):
        ctx.counts, ctx.scale, ctx.p, ctx.keys, ctx.off = counts, scale, p, keys, feature_offset
        ctx.token_ids = token_ids
        wt = w.to(x.dtype).transpose(1, 2)
        xd = _dropped(x, ctx) if p > 0.0 else x
        y = grouped_mm(xd, wt, counts)
        if scale != 1.0:
            y.mul_(scale)
        ctx.save_for_backward(x, w)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        g = grad.contiguous().to(x.dtype)
        if ctx.scale != 1.0:
            g = g * ctx.scale
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_mm(g, w.to(x.dtype), ctx.counts)
            if ctx.p > 0.0:
                grad_x = _dropped(grad_x, ctx)
        if ctx.needs_input_grad[1]:
            xd = _dropped(x, ctx) if ctx.p > 0.0 else x
            grad_w = grouped_mm_wgrad(g, xd, ctx.counts, w.shape[0]).to(w.dtype)  # [E, M, K]
        return grad_x, grad_w, None, None, None, None, None, None


def _dropped(t, ctx):
    """t [N, K] times the keep mask of its rows (group e under keys[e]) / (1 - p)."""
    parts, start = [], 0
    for e, n in enumerate(ctx.counts.counts):
        if n:
            parts.append(keep_mask_at(ctx.keys[e], ctx.p, ctx.token_ids[start:start + n],
                                      ctx.off, t.shape[1]))
        start += n
    mask = torch.cat(parts) if parts else torch.ones(t.shape, dtype=torch.bool, device=t.device)
    return t * mask.to(t.dtype) * (1.0 / (1.0 - ctx.p))


def grouped_linear(x, w, counts: CountsLike, scale=1.0, p=0.0, keys=None, feature_offset=0,
                   token_ids=None):
    """[N, K] tokens split by counts (one group per expert) times w [E, M, K] -> [N, M].
    With p > 0: keys int64 [E, 2] (one per group), token_ids int64 [N] (global token index of
    each row), feature_offset (global index of column 0); the mask is dropout.keep_mask_at's."""
    counts = as_splits(counts, x.device)
    if p > 0.0 and (keys is None or token_ids is None or token_ids.numel() != x.shape[0]):
        raise ValueError(
            f"grouped_linear: dropout p={p} needs keys and token_ids for the {x.shape[0]} rows"
        )
    return _GroupedLinear.apply(x, w, counts, float(scale), float(p), keys,
                                int(feature_offset), token_ids if p > 0.0 else None)


__all__ = ["Splits", "as_splits", "grouped_linear", "grouped_mm", "grouped_mm_wgrad"]
