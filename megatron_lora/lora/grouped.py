"""Grouped LoRA: all local experts' adapters of one linear kind with one grouped matmul per factor.

    lora = GroupedExpertLora("linear_fc1", config, hidden, 2 * ffn, seeds, group=etp_group,
                             stride=2, expert_offset=ep_rank * num_local_experts)
    delta = lora(x, tokens_per_expert, token_ids)          # [N, out_local]

x [N, in_local] holds the dispatcher's permuted tokens, expert by expert (tokens_per_expert[e]
rows for local expert e, zeros allowed). Per factor one grouped matmul over the token splits:
u = scale * x_e A_e^T for every e at once, then y_e = u_e B_e^T; backward likewise (the weight
gradients are grouped matmuls split along the token dimension). `torch._grouped_mm` runs them
on CUDA where it accepts the operands (16-byte aligned strides, bf16 on recent GPUs); otherwise,
and always on CPU, a loop over the splits computes the same products (the exact CPU path). No
[E, in, out] delta weight is ever built.

Factors, stacked over the E local experts (global expert = ep_rank * E + e), same global pairs
as the per-expert path (experts.py) for the same seeds:
    linear_fc1: lora_A [E, r, h] replicated over expert-TP; lora_B [E, g*f/t, r] rows of each
        B_e with partition stride g (rank k: [gate_k; up_k]).
    linear_fc2: lora_A [E, r, f/t] sharded on dim 2; lora_B [E, h, r] replicated.
Reductions are the per-expert ones: the replicated factor's gradient is summed over the
expert-TP group inside autograd (collectives.grad_sum), fc2's output is a partial sum for the
dispatcher, parameters carry `allreduce = False` (expert-data-parallel buffers).

Dropout (training, p > 0) masks row n of local expert e with keep_mask_at(sub_key(key, 2 g + j),
p, token_ids[n], features) (g = expert_offset + e the global expert, j = 0 fc1 / 1 fc2; fc2's
features start at tp_rank * f/t): the per-expert path's masks, so both are layout-independent.
`token_ids` (int64 [N], each row's global token index, see token_route.py) is then required; the
key is `dropout_key` (the MoE layer's, shared by fc1 and fc2) or one drawn per call.
"""

from __future__ import annotations

from typing import List, Sequence

import torch

from megatron_lora.lora import collectives as C
from megatron_lora.lora.factors import init_global_factors, shard_like_base
from megatron_lora.lora.config import AdapterConfig
from megatron_lora.lora.dropout import draw_dropout_key, expert_keys, keep_mask_at


def _offsets(counts: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(counts, dtype=torch.int64, device=device).cumsum(0).to(torch.int32)


def _grouped_kernel(x: torch.Tensor) -> bool:
    """Whether to try torch._grouped_mm: on CUDA. On CPU it is no faster than the loop for large
    groups and several times slower for the LoRA factors' thin products ([N, h] x [h, r]: 0.66 s
    against 0.09 s for 64 groups of 512 x 1024 x 16, measured here), so the loop is used."""
    return x.is_cuda and x.shape[0] > 0 and hasattr(torch, "_grouped_mm")


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: List[int]) -> torch.Tensor:
    """Grouped x_e @ w_e: x [N, K] split by counts, w [E, K, M] -> [N, M]."""
    if _grouped_kernel(x):
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


def grouped_mm_wgrad(x: torch.Tensor, g: torch.Tensor, counts: List[int], num: int) -> torch.Tensor:
    """Per-group x_e^T @ g_e: x [N, K], g [N, M] -> [E, K, M] (zeros for empty groups)."""
    if _grouped_kernel(x) and all(counts):
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
    for e, n in enumerate(ctx.counts):
        if n:
            parts.append(keep_mask_at(ctx.keys[e], ctx.p, ctx.token_ids[start:start + n],
                                      ctx.off, t.shape[1]))
        start += n
    mask = torch.cat(parts) if parts else torch.ones(t.shape, dtype=torch.bool, device=t.device)
    return t * mask.to(t.dtype) * (1.0 / (1.0 - ctx.p))


def grouped_linear(x, w, counts, scale=1.0, p=0.0, keys=None, feature_offset=0,
                   token_ids=None):
    """[N, K] tokens split by counts (one group per expert) times w [E, M, K] -> [N, M].
    With p > 0: keys int64 [E, 2] (one per group), token_ids int64 [N] (global token index of
    each row), feature_offset (global index of column 0); the mask is dropout.keep_mask_at's."""
    counts = [int(c) for c in counts]
    if p > 0.0 and (keys is None or token_ids is None or token_ids.numel() != x.shape[0]):
        raise ValueError(
            f"grouped_linear: dropout p={p} needs keys and token_ids for the {x.shape[0]} rows"
        )
    return _GroupedLinear.apply(x, w, counts, float(scale), float(p), keys,
                                int(feature_offset), token_ids if p > 0.0 else None)


class GroupedExpertLora(torch.nn.Module):
    """The LoRA pairs of one linear kind of E local experts (layout in the module docstring).

    kind: "linear_fc1" (column-like) or "linear_fc2" (row-like).
    in_features / out_features: the GLOBAL sizes of one expert's linear (fc1: h -> g*f).
    group: the expert-TP group (None: one rank); stride: fc1's partition stride (g).
    seeds: one per local expert, from the expert's global name (same as the per-expert path).
    expert_offset: global index of local expert 0 (ep_rank * E): selects the dropout key streams.
    forward(x [N, in_local], tokens_per_expert, token_ids=None, dropout_key=None) -> [N, out_local]
        (fc2: partial over expert-TP); token_ids int64 [N] required for dropout in training.
    """

    def __init__(self, kind, config: AdapterConfig, in_features, out_features, seeds, *,
                 group=None, stride=1, dtype=None, device=None, expert_offset=0):
        super().__init__()
        if kind not in ("linear_fc1", "linear_fc2"):
            raise ValueError(f"kind must be 'linear_fc1' or 'linear_fc2', got {kind!r}")
        self.kind, self.config, self.scaling = kind, config, config.scaling
        self.group = group
        t = 1 if group is None else group.size()
        k = 0 if group is None else group.rank()
        self.tp_size, self.tp_rank, self.in_features = t, k, in_features
        self.expert_offset = int(expert_offset)
        a_list, b_list = [], []
        for seed in seeds:
            a, b = init_global_factors(config, in_features, out_features, int(seed))
            if kind == "linear_fc1":
                b = shard_like_base(b, 0, t, k, stride)
            else:
                a = shard_like_base(a, 1, t, k)
            a_list.append(a)
            b_list.append(b)
        dtype = dtype or config.dtype or torch.float32  # the factors' dtype (config.dtype)
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

    def forward(self, x: torch.Tensor, tokens_per_expert, token_ids=None,
                dropout_key=None) -> torch.Tensor:
        counts = [int(c) for c in (tokens_per_expert.tolist()
                                   if torch.is_tensor(tokens_per_expert) else tokens_per_expert)]
        if len(counts) != self.num_experts or sum(counts) != x.shape[0]:
            raise ValueError(
                f"tokens_per_expert {counts} does not fit {self.num_experts} local experts and "
                f"{x.shape[0]} tokens"
            )
        p = self.config.dropout if self.training else 0.0
        keys = None
        if p > 0.0:
            if token_ids is None or token_ids.numel() != x.shape[0]:
                raise ValueError(
                    f"GroupedExpertLora: dropout {p} in training needs token_ids, the global "
                    f"token index of each of the {x.shape[0]} rows (token_route.py)"
                )
            key = draw_dropout_key(x.device) if dropout_key is None else dropout_key
            j = 0 if self.kind == "linear_fc1" else 1
            keys = expert_keys(key, self.expert_offset, self.num_experts, j)
        a, b = self.lora_A, self.lora_B
        if self.kind == "linear_fc1":
            a = C.grad_sum(a, self.group)
            off = 0
        else:
            b = C.grad_sum(b, self.group)
            off = self.tp_rank * (self.in_features // self.tp_size)
        u = grouped_linear(x, a, counts, self.scaling, p, keys, off, token_ids)  # [N, r]
        return grouped_linear(u, b, counts)  # [N, out_local]

    def delta_weight(self, local_expert: int) -> torch.Tensor:
        """scale * B_e A_e of one local expert, fp32, in its [out_local, in_local] layout."""
        return (self.lora_B[local_expert].detach().float()
                @ self.lora_A[local_expert].detach().float()) * self.scaling


__all__ = ["GroupedExpertLora", "grouped_linear"]
