"""RMSNorm for megatron-core's local (non-TE) layer specs, usable under sequence parallelism."""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lora import runtime


class RMSNorm(torch.nn.Module):
    """y = weight * (x * rsqrt(mean(x^2) + eps)), the normalisation computed in fp32.

    x: [s, b, h] (or [s/t, b, h], the local sequence shard under SP), any float dtype; y has x's
    dtype. The weight [h] is replicated; under sequence parallelism each TP rank sees different
    tokens, so the weight carries `sequence_parallel = True` and megatron's finalize_model_grads
    all-reduces its gradient across TP. megatron's WrappedTorchNorm refuses SP outright, which is
    why CPU specs use this class instead.

    The constructor matches megatron's norm builders (`config, hidden_size, eps, ...`).
    """

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ):
        super().__init__()
        if normalization != "RMSNorm" or zero_centered_gamma:
            raise ValueError(
                f"megatron_lora RMSNorm supports normalization='RMSNorm' without zero-centered "
                f"gamma; got normalization={normalization!r}, "
                f"zero_centered_gamma={zero_centered_gamma}"
            )
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype, device=runtime.device()))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
