"""The LoRA down-projection u = scale * dropout(x) @ A^T, with a lean backward.

One autograd Function, so that what backward keeps is exactly:
- x, the input as the caller handed it (same tensor, same dtype, same sharding: under sequence
  parallelism that is the local sequence shard; no copy is made),
- the dropout key (two integers), from which backward regenerates the mask,
- A (a parameter: no activation memory).
Neither the dropped input nor the mask is kept, and nothing is up-cast: the matmuls run in the
activation dtype, with A cast to it if the factor dtype differs (a weight-sized cast), and A's
gradient is cast back to A's dtype.

The scale is applied to u ([tokens, r]), the cheapest place for it.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_lora.lora.dropout import keep_mask, keep_mask_at


def _dropped(x2: torch.Tensor, ctx) -> torch.Tensor:
    if ctx.token_index is not None:  # expert rows: explicit global token indices
        mask = keep_mask_at(ctx.key, ctx.p, ctx.token_index, ctx.feature_offset, x2.shape[1])
    else:
        mask = keep_mask(
            ctx.key, ctx.p, ctx.token_offset, x2.shape[0], ctx.feature_offset, x2.shape[1]
        )
    return x2 * mask.to(x2.dtype) * (1.0 / (1.0 - ctx.p)), mask


class _LoraDown(torch.autograd.Function):
    """forward: [..., F] x [r, F] -> [..., r] (scaled, dropout on x); backward: grads of x and A,
    regenerating the dropout mask from the saved key."""

    @staticmethod
    def forward(ctx, x, weight, scale, p, key, token_offset, feature_offset, token_index):
        ctx.token_index = token_index
        ctx.scale = scale
        ctx.p = p
        ctx.key = key
        ctx.token_offset = token_offset
        ctx.feature_offset = feature_offset
        ctx.x_shape = x.shape
        w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
        x2 = x.reshape(-1, x.shape[-1])
        if p > 0.0:
            x2, _ = _dropped(x2, ctx)
        u = torch.matmul(x2, w.t())
        u.mul_(scale)
        # x (not x2): the caller's tensor, so saving it costs nothing beyond keeping it alive.
        ctx.save_for_backward(x, weight)
        return u.reshape(tuple(x.shape[:-1]) + (w.shape[0],))

    @staticmethod
    def backward(ctx, grad_u):
        x, weight = ctx.saved_tensors
        w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
        g = grad_u.reshape(-1, grad_u.shape[-1]).to(x.dtype) * ctx.scale  # [T, r]
        x2 = x.reshape(-1, x.shape[-1])
        mask = None
        if ctx.p > 0.0:
            x2, mask = _dropped(x2, ctx)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(g, w)  # [T, F]
            if mask is not None:
                grad_x.mul_(mask.to(grad_x.dtype)).mul_(1.0 / (1.0 - ctx.p))
            grad_x = grad_x.reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = torch.matmul(g.t(), x2).to(weight.dtype)  # [r, F]
        return grad_x, grad_w, None, None, None, None, None, None


def lora_down(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: float,
    p: float = 0.0,
    key: Optional[torch.Tensor] = None,
    token_offset: int = 0,
    feature_offset: int = 0,
    token_index: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """u = scale * dropout_p(x) @ weight^T.

    x: [..., F] activations (e.g. [s, b, F]), F this rank's features.
    weight: [r, F], the A factor (or this rank's column slice of it).
    p, key: dropout probability and key (see dropout.py); key is required when p > 0.
    token_offset / feature_offset: where this rank's tokens (leading dims flattened) and features
        start in the global input, so the mask is the slice of the global mask.
    token_index: int64 [tokens] (leading dims flattened), the global token index of each row
        when the rows are not a contiguous range (expert inputs, dispatcher order); replaces
        token_offset. Kept for backward (8 bytes per token) with the key.
    Returns [..., r].
    """
    if p > 0.0 and key is None:
        raise ValueError("lora_down: a dropout key is required when p > 0")
    if token_index is not None and token_index.numel() != x.numel() // x.shape[-1]:
        raise ValueError(
            f"lora_down: token_index has {token_index.numel()} entries for "
            f"{x.numel() // x.shape[-1]} input rows"
        )
    return _LoraDown.apply(x, weight, float(scale), float(p), key, int(token_offset),
                           int(feature_offset), token_index if p > 0.0 else None)
