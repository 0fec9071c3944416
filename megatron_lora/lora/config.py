"""AdapterConfig: the hyper-parameters of one LoRA adapter on one linear layer.

A frozen dataclass, validated on construction: a bad value raises ValueError naming the field
before anything else (and so before any collective) happens. The adapter never writes to it, and
it never writes to the base layer's megatron config either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

# Factor dtypes that make sense for training: everything else is a configuration mistake.
_FACTOR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INITS = ("kaiming", "gaussian")


@dataclass(frozen=True)
class AdapterConfig:
    """LoRA hyper-parameters for a single linear layer.

    rank: r, the inner size of the update B @ A (1 <= r <= min(in_features, out_features), the
        upper bound is checked against the base layer by LoraAdapter).
    alpha: scaling numerator; the update is scaled by alpha / r, or alpha / sqrt(r) with rsLoRA.
    dropout: probability of zeroing an element of the LoRA input, in [0, 1).
    use_rslora: scale by alpha / sqrt(r) instead of alpha / r.
    init_lora_weights: True or "kaiming" (A kaiming-uniform, B zero: the adapter starts as a no-op),
        "gaussian" (A normal with std 1/r, B zero), or False (A and B both kaiming-uniform, so the
        adapter is not a no-op; meant for tests and for checking that an update is applied).
    dtype: dtype of the factors A and B; None takes the base layer's weight dtype.
    use_dora: DoRA (PEFT's `use_dora`): a trainable magnitude vector m [out] rescales each output
        row of W + scale * B A to m / ||W + scale * B A||_row (see dora.py).
    """

    rank: int
    alpha: float
    dropout: float = 0.0
    use_rslora: bool = False
    init_lora_weights: Union[bool, str] = True
    dtype: Optional[torch.dtype] = None
    use_dora: bool = False

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"AdapterConfig.rank must be a positive integer, got {self.rank!r}")
        if (
            isinstance(self.alpha, bool)
            or not isinstance(self.alpha, (int, float))
            or not math.isfinite(self.alpha)
            or self.alpha <= 0
        ):
            raise ValueError(f"AdapterConfig.alpha must be a finite number > 0, got {self.alpha!r}")
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, (int, float))
            or not 0.0 <= self.dropout < 1.0
        ):
            raise ValueError(f"AdapterConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.use_rslora, bool):
            raise ValueError(f"AdapterConfig.use_rslora must be a bool, got {self.use_rslora!r}")
        if not isinstance(self.init_lora_weights, bool) and self.init_lora_weights not in _INITS:
            raise ValueError(
                "AdapterConfig.init_lora_weights must be True, False, 'kaiming' or 'gaussian', "
                f"got {self.init_lora_weights!r}"
            )
        if not isinstance(self.use_dora, bool):
            raise ValueError(f"AdapterConfig.use_dora must be a bool, got {self.use_dora!r}")
        if self.dtype is not None and self.dtype not in _FACTOR_DTYPES:
            raise ValueError(
                f"AdapterConfig.dtype must be None or one of {_FACTOR_DTYPES}, got {self.dtype!r}"
            )

    @property
    def scaling(self) -> float:
        """The factor the update B @ A is multiplied by."""
        if self.use_rslora:
            return self.alpha / math.sqrt(self.rank)
        return self.alpha / self.rank

    @property
    def init_scheme(self) -> str:
        """'kaiming', 'gaussian' or 'random' (init_lora_weights=False: non-zero B)."""
        if self.init_lora_weights is True:
            return "kaiming"
        if self.init_lora_weights is False:
            return "random"
        return str(self.init_lora_weights)
