"""Layout problems raised for CLI input name the CLI's flags (ParallelLayout.problems(flags=True)),
while the API keeps the field names."""

import pytest

from megatron_lora.runtime import ParallelLayout

SIZES = dict(num_layers=4, num_attention_heads=4, num_query_groups=2, num_experts=4,
             ffn_hidden_size=96, moe_ffn_hidden_size=96)


@pytest.mark.parametrize("layout,world,field_text,flag_text", [
    (ParallelLayout(tp=2), 2, "MoE with tp > 1 needs sequence parallelism (sp=True)",
     "MoE with --tensor-model-parallel-size > 1 needs sequence parallelism (--sequence-parallel)"),
    (ParallelLayout(tp=3, sp=True), 6, "tp=3 does not divide num_attention_heads=4",
     "--tensor-model-parallel-size 3 does not divide num_attention_heads=4"),
    (ParallelLayout(pp=3), 3, "pp=3 does not divide num_layers=4",
     "--pipeline-model-parallel-size 3 does not divide num_layers=4"),
    (ParallelLayout(ep=3), 3, "ep=3 does not divide num_experts=4",
     "--expert-model-parallel-size 3 does not divide num_experts=4"),
    (ParallelLayout(ep=2, etp=2), 2, "world size 2 is not a multiple of ep*etp*pp = 2*2*1 = 4",
     "world size 2 is not a multiple of --expert-model-parallel-size x "
     "--expert-tensor-parallel-size x --pipeline-model-parallel-size = 2 x 2 x 1 = 4"),
    (ParallelLayout(sp=True), 1, "sequence parallelism (sp) needs tp > 1",
     "sequence parallelism (--sequence-parallel) needs --tensor-model-parallel-size > 1"),
])
def test_layout_problems_name_fields_or_flags(layout, world, field_text, flag_text):
    assert any(field_text in p for p in layout.problems(world, **SIZES))
    flagged = layout.problems(world, flags=True, **SIZES)
    assert any(flag_text in p for p in flagged), flagged
    assert not any("=True" in p or p.startswith(("tp=", "pp=", "ep=", "etp=")) for p in flagged)


def test_mixtral_vocab_problem_names_the_flag():
    from megatron_lora.families import ModelInfo  # noqa: F401 (import check)
    from megatron_lora.models.gpt import tiny_moe_shape

    layout = ParallelLayout(tp=3, sp=True)
    assert "--tensor-model-parallel-size 3" in " ".join(
        layout.problems(3, flags=True, **tiny_moe_shape().layout_sizes()))
