"""Comparisons whose bounds come from the arithmetic, and whose failures name the worst element.

`assert_within(actual, expected, bound, what)` fails with the worst element's index, both values,
its difference and the bound. The bounds:

- `sum_rounding_bound(dtype, terms, abs_sum)`: two computations of a sum of `terms` terms whose
  absolute values add up to at most `abs_sum`, in any two orders, differ by at most
  2 * terms * u * abs_sum (u the unit roundoff of `dtype`; each order is within
  terms * u * abs_sum of the exact sum: Higham, Accuracy and Stability of Numerical
  Algorithms, 2nd ed., eq. 4.4).
- `adam_step_bound(lrs, ...)`: one Adam step moves an element by lr * m_hat / (sqrt(v_hat) + eps);
  |m_hat| / sqrt(v_hat) is at most sqrt(sum_k a_k^2 / c_k) over the step's weights a_k of the
  first moment and c_k of the second (Cauchy-Schwarz), 1 at step 1, 1.0014 at step 2 and
  1.0036 at step 3 for betas (0.9, 0.999). An element whose gradient cancels to within its
  rounding error can take that step in either direction, so two runs that only sum in other
  orders can differ there by up to 2 * lr * (that ratio) per step (whatever their gradients:
  the bound holds for every element).
- `reference_bound(reference32, reference64)`: where the reference can also be evaluated in fp64
  (a transformers or plain-torch module, `.double()`): e = max |reference32 - reference64| is the
  reference's own fp32 rounding on these inputs. The rounding of a chain of n operations is of
  size lam sqrt(n) u S (Higham and Mary, see gradient_bound), with the same S for every order
  of the same real computation: so another fp32 evaluation (ours) is within K e of exact for a
  chain up to K**2 = 100 times longer, or a worst element K = 10 times further out, and
  |ours - reference32| <= |ours - exact| + |reference32 - exact| <= (K + 1) e. The fp64
  evaluation stands for the exact value (its own rounding is 2**-29 of fp32's; where the
  reference keeps fp32 steps in fp64, e.g. transformers' RMSNorm, those are the same in both
  and e leaves them out: K covers them). e is at least one rounding of the largest element.
- `assert_adam_trained_close(...)`: adapters trained by Adam at two layouts (other summation orders)
  from the same start: every element within the Adam bound above, and all but a few single
  elements per tensor (those whose gradient nearly cancelled) within a tight bound.
"""

from __future__ import annotations

import math
from typing import Dict, Sequence

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2**-(mantissa bits + 1): 2**-24 for fp32, 2**-53 for fp64, 2**-8 for bf16."""
    return torch.finfo(dtype).eps / 2


def sum_rounding_bound(dtype: torch.dtype, terms: int, abs_sum: float) -> float:
    """The most by which two evaluation orders of a `terms`-term sum in `dtype` can differ, its
    terms' absolute values adding up to at most `abs_sum` (see the module docstring)."""
    return 2 * terms * unit_roundoff(dtype) * abs_sum


def adam_ratio_bound(step: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The largest |m_hat| / sqrt(v_hat) of bias-corrected Adam at `step` (1-based) over every
    gradient history (Cauchy-Schwarz over the moments' weights)."""
    a = [(1 - beta1) * beta1 ** (step - k) / (1 - beta1 ** step) for k in range(1, step + 1)]
    c = [(1 - beta2) * beta2 ** (step - k) / (1 - beta2 ** step) for k in range(1, step + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, c)))


def adam_step_bound(lrs: Sequence[float], beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The most by which one element of two Adam runs from the same start can differ after the
    steps with learning rates `lrs` when the runs' gradients differ by rounding only: each step
    may go the other way where a gradient cancels (2 * lr * the step's largest ratio)."""
    return sum(2 * lr * adam_ratio_bound(k + 1, beta1, beta2) for k, lr in enumerate(lrs))


def adam_tight_bound(lrs: Sequence[float], terms: int, cancellation: float = 100.0,
                     dtype: torch.dtype = torch.float32) -> float:
    """The most by which an element moves between two summation orders where its gradient does
    NOT nearly cancel: a sum of `terms` terms in `dtype` whose absolute sum is at most
    `cancellation` times the gradient is rounded by at most terms * u * cancellation relative
    (rho), which moves Adam's ratio m_hat / sqrt(v_hat) by at most about rho (for rho << 1),
    so the element by rho * adam_step_bound(lrs)."""
    return terms * unit_roundoff(dtype) * cancellation * adam_step_bound(lrs)


def gradient_bound(reference: torch.Tensor, terms: int, cancellation: float = 100.0,
                   lam: float = 6.0) -> float:
    """The most by which two summation orders of an fp32 gradient differ element-wise with
    probability >= 1 - 2 exp(-lam**2 / 2) (3e-8 per element for lam = 6; Higham and Mary, A New
    Approach to Probabilistic Rounding Error Analysis, SIAM J. Sci. Comput. 41(5), 2019: the
    error of a sum of n terms is at most lam sqrt(n) u times their absolute sum, where
    sum_rounding_bound's worst case has n): each element sums at most `terms` terms along its
    chain, whose absolute values add up to at most `cancellation` times the reference's
    largest element."""
    scale = cancellation * float(reference.detach().abs().max())
    return 2 * lam * math.sqrt(terms) * unit_roundoff(torch.float32) * scale


K_ORDERS = 10.0  # see reference_bound


def reference_bound(reference32: torch.Tensor, reference64: torch.Tensor,
                    k: float = K_ORDERS) -> float:
    """(k + 1) x the reference's own fp32 rounding, measured against its fp64 evaluation on the
    same inputs (see the module docstring): the bound for |ours - reference32|, both fp32."""
    r32, r64 = reference32.detach().double().cpu(), reference64.detach().double().cpu()
    if r32.shape != r64.shape:
        raise AssertionError(f"shapes differ: {tuple(r32.shape)} vs {tuple(r64.shape)}")
    if not r64.numel():
        return 0.0
    own = float((r32 - r64).abs().max())
    return (k + 1) * max(own, unit_roundoff(torch.float32) * float(r64.abs().max()))


def worst_element(actual: torch.Tensor, expected: torch.Tensor, bound) -> dict:
    """The element where |actual - expected| - bound is largest: its index, values, diff, bound.
    `bound` is a number or a tensor broadcast to the shape (a per-element bound)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} vs {tuple(e.shape)}")
    diff = (a - e).abs()
    both_nan = torch.isnan(a) & torch.isnan(e)
    diff = torch.where(both_nan, torch.zeros_like(diff), diff.nan_to_num(nan=math.inf))
    b = torch.as_tensor(bound, dtype=torch.float64, device=diff.device).expand_as(diff)
    excess = (diff - b).reshape(-1)
    if not excess.numel():
        return dict(index=(), actual=0.0, expected=0.0, diff=0.0, bound=0.0, over=0, numel=0)
    flat = int(excess.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat, device=diff.device),
                                                      diff.shape))
    return dict(index=index, actual=float(a[index]), expected=float(e[index]),
                diff=float(diff[index]), bound=float(b[index]), over=int((excess > 0).sum()),
                numel=excess.numel())


def describe(what: str, worst: dict) -> str:
    return (f"{what}: worst element {list(worst['index'])}: {worst['actual']:.9g} vs expected "
            f"{worst['expected']:.9g}, |diff| {worst['diff']:.3e} > bound {worst['bound']:.3e} "
            f"({worst['over']} of {worst.get('numel', 0)} elements over)")


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound,
                  what: str = "tensor") -> None:
    """Every |actual - expected| <= bound (a number or a per-element tensor); NaN where the
    other is not NaN fails. The failure names `what`, the worst element and the bound."""
    worst = worst_element(actual, expected, bound)
    if worst["over"]:
        raise AssertionError(describe(what, worst))


def assert_adam_trained_close(actual: Dict[str, torch.Tensor], expected: Dict[str, torch.Tensor],
                              lrs: Sequence[float], tight, what: str = "adapter") -> None:
    """Adam-trained tensors {name: tensor} of a run at another layout against the reference run's.

    Every element is within `adam_step_bound(lrs)`: no summation order moves an element further.
    Within each tensor, at most 1 + numel // 1000 single elements may exceed `tight` (the bound
    for an element whose gradient is well above its rounding error, which the caller derives,
    e.g. adam_tight_bound; a number, or a function of the expected tensor giving per-element
    bounds): going over it takes a gradient cancelled to well under 1/100 of its
    terms' absolute sum AND rounded near the worst case n u, where rounding is typically of
    sqrt(n) u (see gradient_bound), so single elements at most; a wrong gradient, reduction or
    shard moves most elements of a tensor by whole steps."""
    assert sorted(actual) == sorted(expected), (sorted(actual), sorted(expected))
    drift = adam_step_bound(lrs)
    for name in sorted(expected):
        a, e = actual[name], expected[name]
        assert_within(a, e, drift, f"{what} {name} (Adam bound: 2 x lr x |m/sqrt(v)| per step)")
        worst = worst_element(a, e, tight(e) if callable(tight) else tight)
        allowed = 1 + e.numel() // 1000
        if worst["over"] > allowed:
            raise AssertionError(describe(f"{what} {name}: more than {allowed} elements over the "
                                          f"tight bound (a gradient that cancels is rare)", worst))


def mean_loss_bound(losses32: torch.Tensor, losses64: torch.Tensor, tokens: int,
                    k: float = K_ORDERS) -> float:
    """The bound for |ours - losses32| where each loss is a mean over at most `tokens` per-token
    fp32 cross-entropies (one loss per step, or per batch) and `losses64` is the reference's
    fp64 evaluation of the same losses (from the same start, the same steps): reference_bound
    for the forward's rounding (and, after optimizer steps, the adapters' drift that it carries),
    plus two summation orders of the mean of `tokens` positive terms (each within
    lam sqrt(tokens) u of the mean: gradient_bound with cancellation 1), which the fp64 run
    may share with the fp32 one (the loss is reduced in fp32) and so leave out of e."""
    ref = losses32.detach().double().cpu()
    return reference_bound(ref, losses64, k) + gradient_bound(ref, tokens, cancellation=1.0)
