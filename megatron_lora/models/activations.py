"""The gate activation of GPT-OSS's clamped SwiGLU as a picklable callable for TransformerConfig.

transformers' GptOssExperts computes, with gate and up already clamped,
`gate * sigmoid(alpha * gate) * (up + 1)`; megatron's MLP computes
`activation_func(gate) * (up + glu_linear_offset)` after clamping to
`activation_func_clamp_value`, so the activation is x * sigmoid(alpha * x) (megatron's
quick_gelu for alpha 1.702 only), the offset 1. A class rather than a closure, so that configs
holding it can be copied and pickled; equal alphas compare equal.
"""

from __future__ import annotations

import torch


class SigmoidGate:
    """x -> x * sigmoid(alpha * x), elementwise, in x's dtype."""

    def __init__(self, alpha: float):
        self.alpha = float(alpha)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x * self.alpha)

    def __eq__(self, other) -> bool:
        return isinstance(other, SigmoidGate) and other.alpha == self.alpha

    def __hash__(self) -> int:
        return hash((SigmoidGate, self.alpha))

    def __repr__(self) -> str:
        return f"SigmoidGate(alpha={self.alpha})"


__all__ = ["SigmoidGate"]
