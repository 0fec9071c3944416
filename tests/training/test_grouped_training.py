"""Training with grouped experts (--moe-grouped-gemm, models/grouped_experts.py) is training with
SequentialMLP experts: a LoRA run at PP2xEP2 with GroupedExperts gives the losses (within the
reference's own rounding) and the adapters of the same run with SequentialMLP experts at world
size 1, starting from that run's checkpoint (base and adapter weights written by SequentialMLP,
read by GroupedExperts at another layout); and the grouped model's checkpoint loads back into a
SequentialMLP model bit for bit.
The expert fc2 base weights are trainable too (tests/training/_support.py), so the grouped base
weight gradients are exercised, not only the LoRA ones."""

import os

import torch
from safetensors.torch import load_file, save_file

from megatron_lora.lora.model import LoraConfig, apply_lora
from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing import compare
from megatron_lora.testing.reference import load_weights, save_weights
from megatron_lora.training.loop import train
from tests.harness import multirank
from tests.training import _support as S

STEPS = 8
LORA = LoraConfig(r=4, lora_alpha=8, seed=11, use_rslora=True,
                  target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])


def _model(layout, grouped: bool, weights=None):
    from megatron.core import parallel_state

    from megatron_lora.models.gpt import build_gpt_model, transformer_config
    from megatron_lora.models.grouped_experts import GroupedExperts
    from megatron_lora.models.specs import local_block_spec

    config = transformer_config(S.SHAPE, layout)
    spec = local_block_spec(config, pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                            moe_grouped_gemm=grouped)
    model = build_gpt_model(S.SHAPE, config, block_spec=spec)
    kinds = {type(layer.mlp.experts) for layer in model.decoder.layers}
    assert (kinds == {GroupedExperts}) if grouped else (GroupedExperts not in kinds), kinds
    adapters = apply_lora(model, LORA, verbose=False)
    if weights is not None:
        load_weights(model, weights)
    for name, p in model.named_parameters():
        if "lora_" not in name:
            p.requires_grad = any(t in name for t in S.TRAINABLE)
    return model, adapters


def _run(model, layout):
    result = train([model], S.dataset(), S.run_config(iters=STEPS), S.optim(STEPS),
                   layout_name=layout.describe())
    return torch.tensor([result.losses[i] for i in range(1, STEPS + 1)])


@multirank(world_size=1, timeout=300)
def _sequential_reference(directory, layout=ParallelLayout()):
    model, adapters = _model(layout, grouped=False)
    with torch.no_grad():  # non-zero B from the start: a zero B hides gradient bugs
        for ad in adapters.values():
            ad.lora_B.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(3))
    save_weights(model, os.path.join(directory, "start"))
    losses = _run(model, layout)
    tensors = S.global_adapters(adapters)
    tensors["losses"] = losses
    # The same run in fp64 from the same start: the reference's own rounding of its losses.
    model64, _ = _model(layout, grouped=False, weights=os.path.join(directory, "start"))
    tensors["losses64"] = _run(model64.double(), layout)
    save_file(tensors, os.path.join(directory, "reference.safetensors"))


@multirank(world_size=4, timeout=400)
def _grouped_pp2_ep2(directory, layout=ParallelLayout(pp=2, ep=2)):
    reference = load_file(os.path.join(directory, "reference.safetensors"))
    model, adapters = _model(layout, grouped=True, weights=os.path.join(directory, "start"))
    losses = _run(model, layout)
    assert losses[-1] < losses[0] - 0.1  # it trains
    # Means over at most 4 x SEQ token cross-entropies: compare.mean_loss_bound from the
    # reference's fp64 run (forward and Adam steps in another order, the mean's fp32 reduction).
    compare.assert_within(losses, reference["losses"], compare.mean_loss_bound(
        reference["losses"], reference["losses64"], S.run_config().global_batch_size * S.SEQ),
        "grouped losses at PP2xEP2")
    final = S.global_adapters(adapters)
    assert final and all(name in reference for name in final)
    assert any(".experts." in name for name in final)  # this rank checks expert adapters
    S.assert_trained_like(final, reference, S.optim(STEPS).lr, STEPS, "grouped at PP2xEP2")
    # The grouped model's checkpoint is a SequentialMLP checkpoint.
    saved = os.path.join(directory, "grouped_end")
    save_weights(model, saved)
    twin, _ = _model(layout, grouped=False, weights=saved)
    ours = dict(model.named_parameters())
    theirs = dict(twin.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, p in ours.items():
        assert torch.equal(p.detach(), theirs[name].detach()), name


def test_grouped_experts_train_like_sequential_experts(tmp_path):
    _sequential_reference(directory=str(tmp_path))
    _grouped_pp2_ep2(directory=str(tmp_path))
