"""Learned attention sinks and sliding windows for SDPAttention, on torch's fused kernels.

GPT-OSS attention (transformers' `eager_attention_forward` for gpt_oss) adds one learned logit
per head, a "sink", as an extra softmax column that takes probability mass and carries no value,
and restricts alternate layers to a sliding window of the last W keys (`sliding_window`,
`layer_types`). megatron-core names these `softmax_type="learnable"` (parameter
`softmax_offset`, one per head, sharded with the heads over TP) and `window_size=(W - 1, 0)` with
`window_attn_skip_freq` choosing the windowed layers.

torch's scaled_dot_product_attention has neither, so both are expressed through its arguments
and the result is exactly the sink softmax, forward and backward, from the fused kernel:

- the sink is one more key per head. Queries get one more channel holding 1, real keys hold 0
  there and the sink key holds sink / scale, so its score is exactly the sink logit; its value is
  zero, so it adds mass to the denominator and nothing to the output. Autograd then gives the
  sink its true gradient (-sum_i p_sink,i * dO_i . O_i) through that key channel. The channels
  are padded to a multiple of 8 with zeros (CUDA's memory-efficient kernel wants aligned head
  sizes; zeros change no score).
- the window and the causal cut are one additive float mask [b or 1, 1, sq, sk (+ 1 sink
  column, always 0)], combined with a packed-sample mask when there is one: key j is visible to
  query i (at position i + sk - sq) when j <= i + sk - sq and i + sk - sq - j <= W - 1. Within a
  packed row samples are contiguous, so these distances are the per-sample ones and each sample
  keeps its own window and its own sink.

Memory kept for backward: q, k, v as the kernel sees them (k and v expanded to every head, since
each head has its own sink key; head size padded to a multiple of 8 above d), the output, a
per-row log-sum-exp, and the mask, made once per micro-batch (packed: cached on the mask tensor)
or once per shape (unpacked), shared by every layer that uses it. No [b, heads, s, s] tensor.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

_PAD = 8
# Unpacked masks by (sq, sk, causal, window, sink, dtype, device): one per layer kind (windowed
# and full) in training, a few more while generating; the oldest is dropped past this many.
_SHARED_LIMIT = 6
_SHARED: Dict[Tuple, torch.Tensor] = {}


def window_problem(window_size) -> Optional[str]:
    """Why a TransformerConfig.window_size cannot be run as a causal sliding window, or None."""
    if window_size is None:
        return None
    try:
        left, right = (int(v) for v in window_size)
    except (TypeError, ValueError):
        return f"window_size={window_size!r} (a pair (left, right) of ints)"
    if right != 0 or left < -1:
        return (f"window_size={tuple(window_size)} (causal windows only: (W - 1, 0) for a "
                "window of W keys, or (-1, 0) for none)")
    return None


def layer_window(config, layer_number: int) -> Optional[int]:
    """The number of earlier keys a query of this layer may see besides its own (window_size[0]),
    or None for full causal attention; layer_number is megatron's 1-based global number."""
    from megatron.core.transformer.utils import is_layer_window_attention

    window_size = getattr(config, "window_size", None)
    if not window_size or int(window_size[0]) < 0:
        return None
    if not is_layer_window_attention(window_size, getattr(config, "window_attn_skip_freq", None),
                                     layer_number):
        return None
    return int(window_size[0])


def _keep(sq: int, sk: int, causal: bool, window: Optional[int], device) -> torch.Tensor:
    """bool [sq, sk]: True where query i (position i + sk - sq) may see key j."""
    pos = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    dist = pos - torch.arange(sk, device=device).unsqueeze(0)
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        keep &= dist >= 0
    if window is not None:
        keep &= dist <= window
    return keep


def _additive(keep: torch.Tensor, sink: bool, dtype: torch.dtype) -> torch.Tensor:
    """0 / -inf float mask from a keep mask [..., sq, sk], with a zero sink column appended."""
    if sink:
        keep = torch.cat([keep, keep.new_ones(keep.shape[:-1] + (1,))], dim=-1)
    additive = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return additive.masked_fill_(~keep, float("-inf"))


def attention_mask(sq: int, sk: int, causal: bool, window: Optional[int], sink: bool,
                   dtype: torch.dtype, device, packed: Optional[torch.Tensor] = None
                   ) -> torch.Tensor:
    """The additive mask [b or 1, 1, sq, sk (+ 1)] for one call, shared with every other layer of
    the same kind. packed: megatron's boolean mask [b, 1, sq, sk] (True = masked), which then
    replaces the causal cut (it is causal within each sample)."""
    if packed is not None:
        key = (dtype, packed.device, packed._version, window, sink)
        cache = getattr(packed, "_sdpa_sink_window_masks", None)
        if cache is None or cache[0] != packed._version:
            cache = (packed._version, {})
            packed._sdpa_sink_window_masks = cache
        if key not in cache[1]:
            keep = ~packed & _keep(sq, sk, False, window, packed.device)
            cache[1][key] = _additive(keep, sink, dtype)
        return cache[1][key]
    key = (sq, sk, causal, window, sink, dtype, torch.device(device))
    mask = _SHARED.get(key)
    if mask is None:
        mask = _additive(_keep(sq, sk, causal, window, device), sink, dtype).view(1, 1, sq, -1)
        while len(_SHARED) >= _SHARED_LIMIT:
            _SHARED.pop(next(iter(_SHARED)))
        _SHARED[key] = mask
    return mask


def with_sink_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                  scale: float):
    """q [b, n, sq, d], k/v [b, n, sk, d] (one key head per query head), sinks [n] -> q', k', v'
    [b, n, sq | sk + 1, d'] (d' a multiple of 8 above d) whose attention with `scale` is the sink
    softmax: the last key scores sinks[h] against every query, with a zero value."""
    b, n, sq, d = q.shape
    sk = k.shape[2]
    width = (d // _PAD + 1) * _PAD
    extra = width - d
    q_pad = q.new_zeros(b, n, sq, extra)
    q_pad[..., 0] = 1.0
    sink_key = k.new_zeros(b, n, 1, width)
    sink_key[..., d] = (sinks.to(k.dtype) / scale).view(1, n, 1).expand(b, n, 1)
    k_aug = torch.cat([torch.cat([k, k.new_zeros(b, n, sk, extra)], dim=-1), sink_key], dim=2)
    v_aug = torch.cat([v, v.new_zeros(b, n, sk, extra)], dim=-1)
    v_aug = torch.cat([v_aug, v.new_zeros(b, n, 1, width)], dim=2)
    return torch.cat([q, q_pad], dim=-1), k_aug, v_aug


__all__ = ["attention_mask", "layer_window", "window_problem", "with_sink_key"]
