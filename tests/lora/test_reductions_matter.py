"""Each reduction in the LoRA path is needed: switch one off and the parity check fails.

Every scenario runs a case that passes test_parity (at TP=2) with one reduction replaced by its
local, un-reduced version, and asserts that the reference comparison then fails on the
quantities that reduction feeds. A last scenario shows why every numeric test uses a non-zero B:
with B = 0 the same broken reduction goes unnoticed.
"""

import pytest
import torch

from megatron_lora.lora import collectives as C
from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank
from tests.lora import _support as S
from tests.lora._support import Case, patched, replace, run_case


def _no_grad_all_reduce(ctx, grad):  # column, no SP: keep the partial [T, r] gradient
    return grad, None


def _slice_instead_of_reduce_scatter(ctx, grad):  # column, SP: drop the other ranks' partials
    return C._own_slice(grad, ctx.group, 0), None, None


def _always_reduce_scatter(ctx, grad):  # column, SP, gathered output: sum complete gradients
    return C._reduce_scatter_dim0(grad, ctx.group), None, None


def _no_forward_all_reduce(ctx, x, group):  # row, no SP: keep this rank's partial sum
    return x.clone()


def _slice_instead_of_forward_reduce_scatter(ctx, x, group):  # row, SP: partial sum's slice
    ctx.group = group
    return C._own_slice(x, group, 0)


def _zeros_instead_of_gather(ctx, grad):  # row, SP backward: other ranks' tokens missing
    full = grad.new_zeros((grad.shape[0] * 2,) + tuple(grad.shape[1:]))
    rank = torch.distributed.get_rank(ctx.group)
    full[rank * grad.shape[0]:(rank + 1) * grad.shape[0]] = grad
    return full, None


COL = Case("column", sp=False, bias=True)
COL_SP = Case("column", sp=True, bias=True, skip_bias_add=True)
ROW = Case("row", sp=False, bias=True)
ROW_SP = Case("row", sp=True, bias=False)

# (name, case, patch (class, method, replacement) or None, quantities that must now differ)
SCENARIOS = [
    ("column: backward all-reduce of dL/du", COL,
     (C._GradAllReduce, "backward", _no_grad_all_reduce), {"grad_A", "grad_input"}),
    ("column+SP: backward reduce-scatter of dL/du", COL_SP,
     (C._GatherTokens, "backward", _slice_instead_of_reduce_scatter), {"grad_A", "grad_input"}),
    ("column+SP+gather_output: own slice, not a sum, of a complete dL/du",
     replace(COL_SP, gather_output=True),
     (C._GatherTokens, "backward", _always_reduce_scatter), {"grad_A", "grad_input"}),
    ("column+SP: TP sum of A's gradient (finalize_model_grads)", replace(COL_SP, finalize=False),
     None, {"grad_A"}),
    ("row: forward all-reduce of u", ROW,
     (C._AllReduce, "forward", _no_forward_all_reduce), {"output", "loss", "grad_B"}),
    ("row+SP: forward reduce-scatter of u", ROW_SP,
     (C._ReduceScatterTokens, "forward", _slice_instead_of_forward_reduce_scatter),
     {"output", "loss", "grad_B"}),
    ("row+SP: backward all-gather of dL/du", ROW_SP,
     (C._ReduceScatterTokens, "backward", _zeros_instead_of_gather), {"grad_A", "grad_input"}),
    ("row+SP: TP sum of B's gradient (finalize_model_grads)", replace(ROW_SP, finalize=False),
     None, {"grad_B"}),
]


def _run(case, patch):
    if patch is None:
        return run_case(case, 2)["failures"]
    cls, name, fn = patch
    with patched(cls, name, fn):
        return run_case(case, 2)["failures"]


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2)], ids=["TP2"])
@multirank(world_size=2, timeout=300)
def test_disabling_each_reduction_breaks_parity(layout):
    problems = []
    for name, case, patch, expected in SCENARIOS:
        clean = run_case(replace(case, finalize=True), 2)["failures"]
        if clean:
            problems.append(f"{name}: the intact path already fails {clean}")
        broken = set(_run(case, patch))
        if not expected <= broken:
            problems.append(f"{name}: expected {sorted(expected)} to fail, got {sorted(broken)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2)], ids=["TP2"])
@multirank(world_size=2, timeout=300)
def test_zero_B_hides_a_missing_reduction(layout):
    """The reason every numeric test uses init_lora_weights=False (non-zero B)."""
    original = S.build

    def build_with_zero_b(*args, **kwargs):
        config, base, adapter = original(*args, **kwargs)
        with torch.no_grad():
            adapter.lora_B.zero_()
        return config, base, adapter

    S.build = build_with_zero_b
    try:
        broken = _run(COL, (C._GradAllReduce, "backward", _no_grad_all_reduce))
    finally:
        S.build = original
    assert broken == [], f"with B = 0 the broken reduction should go unnoticed, got {broken}"
