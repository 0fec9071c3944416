"""ParallelLayout: one clear message per problem, found without any communication."""

import pytest

from megatron_lora.models.gpt import tiny_moe_shape
from megatron_lora.runtime import LayoutError, ParallelLayout

SIZES = tiny_moe_shape().layout_sizes()  # 4 layers, 4 heads, 2 query groups, 4 experts


@pytest.mark.parametrize(
    "layout,world,expected",
    [
        (ParallelLayout(tp=3, sp=True), 6, "tp=3 does not divide num_attention_heads=4"),
        (ParallelLayout(tp=4, sp=True), 4, "tp=4 does not divide num_query_groups=2"),
        (ParallelLayout(ep=3), 3, "ep=3 does not divide num_experts=4"),
        (ParallelLayout(pp=3), 3, "pp=3 does not divide num_layers=4"),
        (ParallelLayout(tp=2, sp=True), 3, "world size 3 is not a multiple of tp*pp = 2*1 = 2"),
        (ParallelLayout(ep=2, etp=2), 2, "world size 2 is not a multiple of ep*etp*pp = 2*2*1 = 4"),
        (ParallelLayout(tp=2), 2, "MoE with tp > 1 needs sequence parallelism"),
        (ParallelLayout(sp=True), 1, "sequence parallelism (sp) needs tp > 1"),
    ],
)
def test_each_problem_has_one_clear_message(layout, world, expected):
    problems = layout.problems(world, **SIZES)
    assert any(expected in p for p in problems), problems
    with pytest.raises(LayoutError, match="invalid parallel layout"):
        layout.validate(world, **SIZES)


def test_every_problem_is_listed_at_once():
    problems = ParallelLayout(tp=3, pp=3, ep=3).problems(8, **SIZES)
    text = "\n".join(problems)
    for expected in ("tp=3 does not divide num_attention_heads", "pp=3 does not divide num_layers",
                     "ep=3 does not divide num_experts", "not a multiple of tp*pp"):
        assert expected in text


def test_valid_layouts_have_no_problems():
    for layout, world in [(ParallelLayout(tp=2, sp=True), 2), (ParallelLayout(ep=2), 2),
                          (ParallelLayout(tp=2, pp=2, ep=2, sp=True), 8), (ParallelLayout(pp=2, ep=2), 4)]:
        assert layout.problems(world, **SIZES) == []


def test_dense_model_refuses_expert_parallelism():
    sizes = tiny_moe_shape(num_experts=None).layout_sizes()
    assert "ep=2 needs a model with experts (this model has none)" in ParallelLayout(ep=2).problems(2, **sizes)


@pytest.mark.parametrize("bad", [dict(tp=0), dict(pp=-1), dict(ep=1.5), dict(etp=0)])
def test_sizes_must_be_positive_integers(bad):
    name = next(iter(bad))
    with pytest.raises(LayoutError, match=f"{name} must be a positive integer"):
        ParallelLayout(**bad)


@pytest.mark.parametrize("text", ["TP2xEP2+SP", "PP2xEP2", "TP2xPP2xEP2+SP", "TP1", "EP4xETP1"])
def test_parse_and_describe_round_trip(text):
    assert ParallelLayout.parse(ParallelLayout.parse(text).describe()) == ParallelLayout.parse(text)


def test_parse_rejects_garbage():
    with pytest.raises(LayoutError, match="cannot parse layout"):
        ParallelLayout.parse("TP2xfoo")
