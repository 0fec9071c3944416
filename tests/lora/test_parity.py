"""Forward, loss and every gradient of a LoRA-wrapped megatron linear equal a single-process
reference built from the same global weights, at TP 1/2/4 with and without SP, for column and
row bases x gather_output / input_is_parallel x bias x skip_bias_add x dropout (fp32, non-zero
B). Each element is held to 2 gamma_n S: S the sum of |terms| it adds up (the reference graph on
the absolute values of its leaves), n the roundings along its chain (tests/lora/_support.py CHAIN,
tests/lora/_bounds.py). One body per TP size runs every case (worlds are expensive to start)."""

import pytest

from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank
from tests.lora._support import all_cases, run_case


@pytest.mark.parametrize(
    "layout", [ParallelLayout(tp=1), ParallelLayout(tp=2), ParallelLayout(tp=4)],
    ids=["TP1", "TP2", "TP4"],
)
@multirank(world_size=lambda layout, **_: layout.tp, timeout=400)
def test_every_case_matches_single_process_reference(layout):
    cases = all_cases(layout.tp)
    report = {}
    for case in cases:
        result = run_case(case, layout.tp)
        if result["failures"]:
            report[case.name()] = result
    assert not report, f"{len(report)}/{len(cases)} cases differ from the reference: {report}"
