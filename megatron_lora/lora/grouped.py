"""Grouped LoRA: all local experts' adapters of one linear kind with one grouped matmul per factor.

    lora = GroupedExpertLora(kind="linear_fc1", ...)       # or from_experts / wrap_grouped_experts
    delta = lora(x, tokens_per_expert)                     # [N, out_local]

x [N, in_local] holds the dispatcher's permuted tokens, expert by expert (tokens_per_expert[e]
rows for local expert e, zeros allowed). Per factor one grouped matmul over the token splits:
u = scale * x_e A_e^T for every e at once, then y_e = u_e B_e^T; backward likewise (the weight
gradients are grouped matmuls split along the token dimension). `torch._grouped_mm` runs them
where it accepts the operands (16-byte aligned strides; CPU and recent GPUs); otherwise a loop
over the splits computes the same products (the reference CPU path). No [E, in, out] delta
weight is ever built.

Factors, stacked over the E local experts (global expert = ep_rank * E + e), same global pairs
as the per-expert path (experts.py) for the same seeds:
    linear_fc1: lora_A [E, r, h] replicated over expert-TP; lora_B [E, g*f/t, r] rows of each
        B_e with partition stride g (rank k: [gate_k; up_k]).
    linear_fc2: lora_A [E, r, f/t] sharded on dim 2; lora_B [E, h, r] replicated.
Reductions are the per-expert ones: the replicated factor's gradient is summed over the
expert-TP group inside autograd (collectives.grad_sum), fc2's output is a partial sum for the
dispatcher, parameters carry `allreduce = False` (expert-data-parallel buffers).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from megatron_lora.lora import collectives as C
from megatron_lora.lora.adapter import _shard, init_global_factors
from megatron_lora.lora.config import AdapterConfig
from megatron_lora.lora.dropout import draw_dropout_key, keep_mask


def _offsets(counts: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64, device=device).cumsum(0).to(torch.int32)


def _gmm(x: torch.Tensor, w: torch.Tensor, counts: List[int]) -> torch.Tensor:
    """Grouped x_e @ w_e: x [N, K] split by counts, w [E, K, M] -> [N, M]."""
    if x.shape[0] > 0 and hasattr(torch, "_grouped_mm"):
        try:
            return torch._grouped_mm(x, w, offs=_offsets(counts, x.device))
        except RuntimeError:
            pass  # operands it does not take (alignment, dtype): the loop below is exact
    out = x.new_empty((x.shape[0], w.shape[2]))
    start = 0
    for e, n in enumerate(counts):
        if n:
            torch.matmul(x[start:start + n], w[e], out=out[start:start + n])
        start += n
    return out


def _gmm_wgrad(x: torch.Tensor, g: torch.Tensor, counts: List[int], num: int) -> torch.Tensor:
    """Per-group x_e^T @ g_e: x [N, K], g [N, M] -> [E, K, M] (zeros for empty groups)."""
    if x.shape[0] > 0 and hasattr(torch, "_grouped_mm") and all(counts):
        try:
            return torch._grouped_mm(x.t(), g, offs=_offsets(counts, x.device))
        except RuntimeError:
            pass
    out = x.new_zeros((num, x.shape[1], g.shape[1]))
    start = 0
    for e, n in enumerate(counts):
        if n:
            torch.matmul(x[start:start + n].t(), g[start:start + n], out=out[e])
        start += n
    return out


class _GroupedLinear(torch.autograd.Function):
    """forward: y_e = s * drop(x_e) @ w_e^T for w [E, M, K]; backward: grads of x and w, the
    dropout mask regenerated from its key (nothing but x and w kept)."""

    @staticmethod
    def forward(ctx, x, w, counts, scale, p, key, feature_offset):
        ctx.counts, ctx.scale, ctx.p, ctx.key, ctx.off = counts, scale, p, key, feature_offset
        wt = w.to(x.dtype).transpose(1, 2)
        xd = _dropped(x, ctx) if p > 0.0 else x
        y = _gmm(xd, wt, counts)
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
            grad_x = _gmm(g, w.to(x.dtype), ctx.counts)
            if ctx.p > 0.0:
                grad_x = _dropped(grad_x, ctx)
        if ctx.needs_input_grad[1]:
            xd = _dropped(x, ctx) if ctx.p > 0.0 else x
            grad_w = _gmm_wgrad(g, xd, ctx.counts, w.shape[0]).to(w.dtype)  # [E, M, K]
        return grad_x, grad_w, None, None, None, None, None


def _dropped(t, ctx):
    mask = keep_mask(ctx.key, ctx.p, 0, t.shape[0], ctx.off, t.shape[1])
    return t * mask.to(t.dtype) * (1.0 / (1.0 - ctx.p))


def grouped_linear(x, w, counts, scale=1.0, p=0.0, key=None, feature_offset=0):
    """[N, K] tokens split by counts (one group per expert) times w [E, M, K] -> [N, M]."""
    return _GroupedLinear.apply(x, w, [int(c) for c in counts], float(scale), float(p), key,
                                int(feature_offset))


class GroupedExpertLora(torch.nn.Module):
    """The LoRA pairs of one linear kind of E local experts (layout in the module docstring).

    kind: "linear_fc1" (column-like) or "linear_fc2" (row-like).
    in_features / out_features: the GLOBAL sizes of one expert's linear (fc1: h -> g*f).
    group: the expert-TP group (None: one rank); stride: fc1's partition stride (g).
    seeds: one per local expert, from the expert's global name (same as the per-expert path).
    forward(x [N, in_local], tokens_per_expert) -> [N, out_local] (fc2: partial over expert-TP).
    """

    def __init__(self, kind, config: AdapterConfig, in_features, out_features, seeds, *,
                 group=None, stride=1, dtype=torch.float32, device=None):
        super().__init__()
        if kind not in ("linear_fc1", "linear_fc2"):
            raise ValueError(f"kind must be 'linear_fc1' or 'linear_fc2', got {kind!r}")
        self.kind, self.config, self.scaling = kind, config, config.scaling
        self.group = group
        t = 1 if group is None else group.size()
        k = 0 if group is None else group.rank()
        self.tp_size, self.tp_rank, self.in_features = t, k, in_features
        a_list, b_list = [], []
        for seed in seeds:
            a, b = init_global_factors(config, in_features, out_features, int(seed))
            if kind == "linear_fc1":
                b = _shard(b, 0, t, k, stride)
            else:
                a = _shard(a, 1, t, k)
            a_list.append(a)
            b_list.append(b)
        self.lora_A = torch.nn.Parameter(torch.stack(a_list).to(device=device, dtype=dtype))
        self.lora_B = torch.nn.Parameter(torch.stack(b_list).to(device=device, dtype=dtype))
        sharded, replicated, dim = ((self.lora_B, self.lora_A, 1) if kind == "linear_fc1"
                                    else (self.lora_A, self.lora_B, 2))
        sharded.tensor_model_parallel, sharded.partition_dim = True, dim
        replicated.tensor_model_parallel, replicated.partition_dim = False, -1
        for p in (self.lora_A, self.lora_B):
            p.partition_stride = stride if (p is self.lora_B and kind == "linear_fc1") else 1
            p.allreduce = False  # expert-data-parallel buffers
            p.sequence_parallel = False

    @property
    def num_experts(self) -> int:
        return self.lora_A.shape[0]

    def forward(self, x: torch.Tensor, tokens_per_expert) -> torch.Tensor:
        counts = [int(c) for c in (tokens_per_expert.tolist()
                                   if torch.is_tensor(tokens_per_expert) else tokens_per_expert)]
        if len(counts) != self.num_experts or sum(counts) != x.shape[0]:
            raise ValueError(
                f"tokens_per_expert {counts} does not fit {self.num_experts} local experts and "
                f"{x.shape[0]} tokens"
            )
        p = self.config.dropout if self.training else 0.0
        key = draw_dropout_key(x.device) if p > 0.0 else None
        a, b = self.lora_A, self.lora_B
        if self.kind == "linear_fc1":
            a = C.grad_sum(a, self.group)
            off = 0
        else:
            b = C.grad_sum(b, self.group)
            off = self.tp_rank * (self.in_features // self.tp_size)
        u = grouped_linear(x, a, counts, self.scaling, p, key, off)  # [N, r]
        return grouped_linear(u, b, counts)  # [N, out_local]

    def delta_weight(self, local_expert: int) -> torch.Tensor:
        """scale * B_e A_e of one local expert, fp32, in its [out_local, in_local] layout."""
        return (self.lora_B[local_expert].detach().float()
                @ self.lora_A[local_expert].detach().float()) * self.scaling


__all__ = ["GroupedExpertLora", "grouped_linear"]
