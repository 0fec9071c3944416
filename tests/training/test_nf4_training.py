"""LoRA and DoRA trained on an NF4 base (models/nf4_model.py) give the one-rank run's losses and
adapters (DoRA's magnitudes too) at TP2xEP2+SP and at TP2xETP1+SP, where the experts' group
(expert-TP 1: each expert whole, quantised without a gather) is not the attention's (TP2), fp32,
dropout 0.1 (LoRA on every adapter kind: attention, router, experts; DoRA on attention and
experts, its weight norms from the dequantised base), so the NF4 linears keep megatron's
TP/SP/expert semantics in forward and backward. Widths are 128 so that a TP2 / ETP2 shard of a
row-parallel linear holds whole blocks of 64."""

import dataclasses
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_lora.lora.model import LoraConfig, apply_lora
from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing import compare
from megatron_lora.testing.reference import load_weights, save_weights
from megatron_lora.training.loop import train
from tests.harness import multirank
from tests.training import _support as S

pytest.importorskip("bitsandbytes")

SHAPE = dataclasses.replace(S.SHAPE, hidden_size=128, ffn_hidden_size=128, num_layers=2)
STEPS = 4
LORA = LoraConfig(r=4, lora_alpha=8, seed=11, lora_dropout=0.1,
                  target_modules=["linear_qkv", "linear_proj", "router", "linear_fc1",
                                  "linear_fc2"])
DORA = LoraConfig(r=4, lora_alpha=8, seed=11, lora_dropout=0.1, use_dora=True,
                  target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
VARIANTS = {"lora": LORA, "dora": DORA}


def _model(layout, weights=None):
    from megatron_lora.models.gpt import build_gpt_model, transformer_config
    from megatron_lora.models.nf4_model import quantize_base

    model = build_gpt_model(SHAPE, transformer_config(SHAPE, layout))
    if weights is None:
        return model
    load_weights(model, weights)
    quantize_base(model)
    return model


def _train(model, variant):
    adapters = apply_lora(model, VARIANTS[variant], verbose=False)
    result = train([model], S.dataset(samples=16), S.run_config(iters=STEPS), S.optim(STEPS),
                   layout_name="nf4")
    tensors = S.global_adapters(adapters)
    tensors["losses"] = torch.tensor([result.losses[i] for i in range(1, STEPS + 1)])
    return tensors


def _losses64(model, variant):
    """The losses of the same run in fp64 (model and adapters `.double()`; the NF4 codes stay,
    their block scales and the dequantised weights are fp64)."""
    apply_lora(model, VARIANTS[variant], verbose=False)
    model.double()
    result = train([model], S.dataset(samples=16), S.run_config(iters=STEPS), S.optim(STEPS),
                   layout_name="nf4")
    return torch.tensor([result.losses[i] for i in range(1, STEPS + 1)], dtype=torch.float64)


@multirank(world_size=1, timeout=300)
def _reference(directory, layout=ParallelLayout()):
    weights = os.path.join(directory, "weights")
    save_weights(_model(layout), weights)  # the full-precision base, megatron's random init
    for variant in VARIANTS:
        tensors = _train(_model(layout, weights), variant)
        tensors["losses64"] = _losses64(_model(layout, weights), variant)
        save_file(tensors, os.path.join(directory, f"{variant}.safetensors"))


@pytest.fixture(scope="module")
def nf4_reference(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("nf4_train_reference"))
    _reference(directory=directory)
    return directory


CASES = [
    pytest.param(ParallelLayout(tp=2, ep=2, sp=True), 4, id="TP2xEP2+SP"),
    pytest.param(ParallelLayout(tp=2, etp=1, sp=True), 2, id="TP2xETP1+SP"),
]


@pytest.mark.parametrize("layout,world_size", CASES)
@multirank(world_size=lambda world_size, **_: world_size, timeout=400)
def test_lora_and_dora_on_nf4_base_match_one_rank(layout, world_size, nf4_reference):
    for variant in VARIANTS:
        reference = load_file(os.path.join(nf4_reference, f"{variant}.safetensors"))
        final = _train(_model(layout, os.path.join(nf4_reference, "weights")), variant)
        # Means over at most 4 x SEQ token cross-entropies: compare.mean_loss_bound from the
        # reference's fp64 run (forward and Adam steps in another order, the mean's reduction).
        losses64 = reference.pop("losses64")
        compare.assert_within(final.pop("losses"), reference["losses"], compare.mean_loss_bound(
            reference["losses"], losses64, S.run_config().global_batch_size * S.SEQ),
            f"{variant} losses at {layout.describe()}")
        assert final and all(name in reference for name in final)  # EP: this rank's experts
        assert any(name.endswith(".m") for name in final) == (variant == "dora")
        for name, tensor in final.items():
            if name.endswith(".B"):
                assert tensor.abs().max() > 0  # B has moved away from its zero init
        S.assert_trained_like(final, reference, S.optim(STEPS).lr, STEPS,
                              f"{variant} at {layout.describe()}")
