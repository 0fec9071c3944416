"""rank_pattern / alpha_pattern keys must match an adapter: one that matches none is an error
naming the pattern, the same on every pipeline stage (the check uses global names)."""

import pytest
import torch.distributed as dist

from megatron_lora.lora.model import LoraConfig, apply_lora, config_problems
from megatron_lora.models.gpt import build_gpt_model, tiny_moe_shape, transformer_config
from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank

DENSE = tiny_moe_shape(num_experts=None)


@multirank(world_size=2)
def test_a_pattern_that_matches_no_adapter_is_an_error_on_every_stage(layout=ParallelLayout(pp=2)):
    model = build_gpt_model(DENSE, transformer_config(DENSE, layout))
    before = [p.requires_grad for p in model.parameters()]
    with pytest.raises(ValueError, match=r"rank_pattern 'experts' matches no adapter of this "
                       r"model .* 'decoder\.layers\.0\.self_attention\.linear_qkv'"):
        apply_lora(model, LoraConfig(r=4, rank_pattern={"experts": 2}))  # a dense model
    with pytest.raises(ValueError, match=r"alpha_pattern 'linear_fc1' matches no adapter"):
        apply_lora(model, LoraConfig(r=4, target_modules=["linear_qkv"],
                                     alpha_pattern={"linear_fc1": 8.0}))
    assert [p.requires_grad for p in model.parameters()] == before
    # layer 3 lives on the second stage only; the first accepts the pattern as well
    apply_lora(model, LoraConfig(r=4, target_modules=["linear_qkv"],
                                 alpha_pattern={r"layers\.3\.": 8.0}), verbose=False)
    dist.barrier()


def test_cli_names_are_used_in_the_message():
    (problem,) = config_problems(LoraConfig(r=2, target_modules=["linear_qkv"],
                                            rank_pattern={"router": 1}),
                                 transformer_config(DENSE, ParallelLayout()), DENSE.vocab_size,
                                 pattern_name="--lora-rank-pattern",
                                 targets_name="--lora-target-modules")
    assert problem.startswith("--lora-rank-pattern 'router' matches no adapter of this model "
                              "(it is searched in the global names of the --lora-target-modules "
                              "adapters"), problem
