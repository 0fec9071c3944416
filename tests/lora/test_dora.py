"""DoRA (`use_dora`, train --lora-use-dora): a DoRA-wrapped megatron linear equals PEFT's formula
computed on the global tensors in plain torch (tests/lora/_dora_support.py): output and the
gradients of the input, A, B and the magnitude, fp32, each element within 2 gamma_n S (S from
the formula on the leaves' absolute values, n = _dora_support.CHAIN; tests/lora/_bounds.py;
the experts: compare.gradient_bound), non-zero B, the magnitude initialised to ||W + s B A||_row
and then moved off it; dropout 0.25 with rsLoRA; merge gives the
eval output from the base alone and unmerge restores the weight. Every LoRA parity case (column /
row x SP x gather_output / input_is_parallel x bias x skip_bias_add x dropout, megatron DDP +
finalize_model_grads, TE-style bases) at TP1 and TP2; each check is shown able to fail by
switching off the row-parallel norm all-reduce and the magnitude's SP gradient reduction."""

import contextlib

import pytest
import torch

from megatron_lora.lora import AdapterConfig, LoraAdapter
from megatron_lora.lora import dora as D
from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank
from tests.lora import _support as S


def test_config_validates_use_dora():
    with pytest.raises(ValueError, match="AdapterConfig.use_dora must be a bool"):
        AdapterConfig(rank=4, alpha=8, use_dora="yes")
    assert AdapterConfig(rank=4, alpha=8, use_dora=True).use_dora is True


def test_lora_config_refuses_dora_on_router_and_embedding():
    from megatron_lora.lora.model import LoraConfig

    for target in ("router", "embedding", "output_layer"):
        with pytest.raises(ValueError, match="--lora-use-dora"):
            LoraConfig(target_modules=["linear_qkv", target], use_dora=True)
    cfg = LoraConfig(use_dora=True)
    assert cfg.to_dict()["use_dora"] is True and cfg.adapter_config("x").use_dora
    assert "use_dora" not in LoraConfig().to_dict()  # plain LoRA checkpoints are unchanged


@contextlib.contextmanager
def _partial_norms():
    """Each rank's partial squared row norms taken as complete (the all-reduce switched off)."""
    original = D._group_size
    D._group_size = lambda group: 1
    try:
        yield
    finally:
        D._group_size = original


def _cases(tp):
    cases = [c for c in S.all_cases(tp, dropouts=(0.0, 0.25))]
    return cases


@pytest.mark.parametrize("layout", [ParallelLayout(tp=1), ParallelLayout(tp=2)],
                         ids=["TP1", "TP2"])
@multirank(world_size=lambda layout, **_: layout.tp, timeout=400)
def test_dora_matches_peft_formula_at_every_case(layout):
    from tests.lora._dora_support import run_dense_case

    report = {}
    cases = _cases(layout.tp)
    for case in cases:
        bad = run_dense_case(case, layout.tp)
        if bad:
            report[case.name()] = bad
    assert not report, f"{len(report)}/{len(cases)} DoRA cases differ: {report}"


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2)], ids=["TP2"])
@multirank(world_size=2, timeout=300)
def test_dora_reductions_matter(layout):
    """Without the [out] all-reduce of the row-parallel squared norms, or without the magnitude's
    SP gradient reduction, the same parity check fails on the quantities they feed."""
    from tests.lora._dora_support import run_dense_case

    row = S.Case("row", sp=False, bias=True)
    row_sp = S.Case("row", sp=True, bias=False)
    col_sp = S.Case("column", sp=True, bias=True)
    for case in (row, row_sp, col_sp):
        assert not run_dense_case(case, 2), case.name()
    bad = set(run_dense_case(row, 2, check_merge=False, during=_partial_norms))
    assert {"output", "grad_input", "grad_A", "grad_B", "grad_magnitude"} <= bad, bad
    assert "magnitude_init" not in bad

    original_attrs = LoraAdapter._set_parallel_attributes

    def no_sp_flag(self, base_weight):
        original_attrs(self, base_weight)
        if self.magnitude is not None:
            self.magnitude.sequence_parallel = False

    LoraAdapter._set_parallel_attributes = no_sp_flag
    try:
        bad = set(run_dense_case(row_sp, 2, check_merge=False))
    finally:
        LoraAdapter._set_parallel_attributes = original_attrs
    assert bad == {"grad_magnitude"}, bad


MOE_LAYOUTS = [ParallelLayout(tp=1), ParallelLayout(tp=2, ep=2, etp=2, sp=True)]


@pytest.mark.parametrize("layout", MOE_LAYOUTS, ids=["TP1", "TP2xEP2xETP2+SP"])
@multirank(world_size=lambda layout, **_: max(layout.tp, layout.ep * layout.expert_tp),
           timeout=400)
def test_dora_experts_match_reference(layout):
    """Every expert's fc1 / fc2 with DoRA (SequentialMLP and grouped experts), router LoRA,
    through megatron DDP + finalize_model_grads, against the global reference; at expert-TP 2
    the fc2 norms need their [out] all-reduce over the expert-TP group (shown below)."""
    from tests.lora._dora_support import run_moe_dora_case

    report = {}
    variants = [("alltoall", 0.0, False, False), ("allgather", 0.25, True, False),
                ("alltoall", 0.25, True, True)]
    for dispatcher, p, rslora, grouped in variants:
        bad = run_moe_dora_case(layout, dispatcher, dropout=p, rslora=rslora, grouped=grouped)
        if bad:
            report[f"{dispatcher}/p{p}/{'grouped' if grouped else 'sequential'}"] = bad
    assert not report, report
    if layout.expert_tp > 1:
        bad = run_moe_dora_case(layout, "alltoall", during=_partial_norms)
        assert any(k.endswith("linear_fc2.magnitude") for k in bad), bad
        assert "output" in bad and "grad_input" in bad, bad
