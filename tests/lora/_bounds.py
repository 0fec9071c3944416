"""Per-quantity fp32 bounds for the single-layer parity checks (tests/lora/_support.py,
_moe_support.py, _dora_support.py), and the record of how close each comparison came.

`judge(got, want, bound, what)` returns None when every element is within its bound, else a
line naming the worst element, its index, both values and the bound (compare.describe); every
comparison's worst |diff| / bound also goes to the file named by $MEGATRON_LORA_MARGINS (one
line per comparison: "ratio largest-bound what"), so a run can report its margins.

Where the bounds come from (u = 2**-24, fp32):
- `shadow_bound(n, shadow)`: the reference and the layer compute each element as the same
  products and sums in other orders (the layer splits sums over TP ranks and all-reduces the
  partials). Each is within gamma_n * S of the exact value, gamma_n = n u / (1 - n u), where S is
  the sum of the absolute values of every product term feeding the element and n the number of
  roundings along its longest chain (Higham, Accuracy and Stability of Numerical Algorithms,
  2nd ed., section 3.5: a matrix product chain's inner dimensions add up). S is what the same
  graph computes from the absolute values of its leaves (all ops are sums and products with
  non-negative constants; DoRA's row norm is detached, a constant of the graph, whose own
  rounding the chain's n covers), so two orders differ by at most 2 gamma_n S, per element.
- `compare.gradient_bound(ref, n)`: for graphs with non-linear steps (the MoE layer's softmax,
  SiLU and top-k weights), where S cannot be read off an absolute-value graph: the
  probabilistic bound lam sqrt(n) u (lam = 6) on a sum of n terms, taken twice, with the terms'
  absolute values adding up to at most 100 times the quantity's largest element.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch

from megatron_lora.testing import compare

U = compare.unit_roundoff(torch.float32)


def shadow_bound(n: int, shadow: torch.Tensor) -> torch.Tensor:
    """2 gamma_n S per element (see the module docstring); shadow = S, from |leaves|."""
    return 2 * (n * U / (1 - n * U)) * shadow.detach().double()


def moe_bound(reference: torch.Tensor, n: int) -> float:
    """compare.gradient_bound of a quantity of a non-linear graph of n-term chains."""
    return compare.gradient_bound(reference.float(), n)


def judge(got: Optional[torch.Tensor], want: torch.Tensor, bound, what: str) -> Optional[str]:
    """None when |got - want| <= bound everywhere; else why not (the worst element, its index,
    the bound). Logs the worst ratio |diff| / bound to $MEGATRON_LORA_MARGINS when set."""
    if got is None or tuple(got.shape) != tuple(want.shape):
        return f"{what}: got {None if got is None else tuple(got.shape)}, want {tuple(want.shape)}"
    worst = compare.worst_element(got, want, bound)
    _log(what, got, want, bound)
    return compare.describe(what, worst) if worst["over"] else None


def _log(what, got, want, bound) -> None:
    path = os.environ.get("MEGATRON_LORA_MARGINS")
    if not path:
        return
    diff = (got.detach().double() - want.detach().double()).abs()
    b = torch.as_tensor(bound, dtype=torch.float64).expand_as(diff)
    ratio = torch.where(diff == 0, torch.zeros_like(diff), diff / b)
    with open(path, "a") as f:
        kind = re.sub(r"\.\d+\.", ".E.", what)  # one line per quantity, whichever expert
        worst = float(ratio.max()) if ratio.numel() else 0.0
        f.write(f"{worst:.6g} {float(b.max()) if b.numel() else 0.0:.3g} {kind}\n")
