"""Query and key RMSNorms over the whole projection width (OLMoE), exact under tensor parallelism.

megatron-core's `qk_layernorm` normalises each head on its own ([d] weights). OLMoE normalises the
whole query projection ([n*d] weight, one RMS over all n*d channels of a token) and the whole key
projection ([g*d]). Under TP each rank holds n/tp query heads (g/tp key heads), so a rank alone
sees only part of the mean of squares: each rank sums its channels' squares per token, the sums
are all-reduced over the tensor-parallel group, and every rank divides by the global width. With
sequence parallelism nothing changes: linear_qkv has already all-gathered the sequence, so the
query is [s, b, n/tp, d] on every rank.

The weight is this rank's [n/tp * d] slice of the global [n*d] vector (heads in Hugging Face
order: rank r holds heads r*n/tp .. (r+1)*n/tp - 1), sharded over TP on axis 0 in the checkpoint
like a column-parallel bias, so one checkpoint loads at any TP. Its gradient is complete on each
rank (every rank sees all tokens of its own channels): it is not marked `sequence_parallel`.

The spec builds `FullWidthQueryNorm` as q_layernorm and `FullWidthKeyNorm` as k_layernorm;
megatron passes them `hidden_size` = the head dimension d.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_lora import runtime


class _SumOverGroup(torch.autograd.Function):
    """forward: all-reduce each token's partial sum of squares; backward: all-reduce its grad."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        # Each rank's gradient covers only its own channels' use of the sum: add them up.
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_over_group(x: torch.Tensor, group) -> torch.Tensor:
    """Per-rank partial sums -> their sum over `group`, replicated (identity for one rank)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _SumOverGroup.apply(x.contiguous(), group)


class FullWidthRMSNorm(torch.nn.Module):
    """y = weight * (x * rsqrt(mean over all heads' channels of x^2 + eps)), computed in fp32.

    x: [s, b, heads/tp, d] (any float dtype); y has x's shape and dtype. `heads` (a subclass
    attribute) says which projection: "query" (n = num_attention_heads heads) or "key"
    (g = num_query_groups heads).
    """

    heads: str = ""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                 tp_group: Optional[dist.ProcessGroup] = None, **kwargs):
        super().__init__()
        count = {"query": config.num_attention_heads, "key": config.num_query_groups}[self.heads]
        tp = config.tensor_model_parallel_size
        if count % tp:
            raise ValueError(f"{self.heads} heads={count} must divide by the tensor-parallel "
                             f"size {tp}")
        if tp > 1 and tp_group is None:
            from megatron.core import parallel_state

            tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_group, self.eps = tp_group, eps
        self.width = count * hidden_size  # the global width the mean runs over
        self.weight = torch.nn.Parameter(
            torch.ones(count // tp * hidden_size, dtype=config.params_dtype,
                       device=runtime.device()))
        # TP-sharded like a column-parallel bias (megatron's grad-norm and checkpoint code read
        # these attributes): not a TP duplicate, and its gradient needs no TP sum.
        for name, value in (("tensor_model_parallel", True), ("partition_dim", 0),
                            ("partition_stride", 1)):
            setattr(self.weight, name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float().flatten(-2)
        squares = sum_over_group(h.pow(2).sum(-1, keepdim=True), self.tp_group)
        h = h * torch.rsqrt(squares / self.width + self.eps)
        return (self.weight * h.to(x.dtype)).view(x.shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The weight as this rank's axis-0 slice of the global [heads*d] (stacked over layers by
        `sharded_offsets`), so a checkpoint saved at one TP loads at any other."""
        dp_cp = (metadata or {}).get("dp_cp_group")
        if dp_cp is None:
            from megatron.core import parallel_state

            dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        tp_group = self.tp_group
        if tp_group is None:
            from megatron.core import parallel_state

            tp_group = parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0}, sharded_offsets,
            tp_group=tp_group, dp_cp_group=dp_cp)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]} of {self.width}, eps={self.eps}"


class FullWidthQueryNorm(FullWidthRMSNorm):
    """q_layernorm over all n*d query channels."""

    heads = "query"


class FullWidthKeyNorm(FullWidthRMSNorm):
    """k_layernorm over all g*d key channels."""

    heads = "key"
