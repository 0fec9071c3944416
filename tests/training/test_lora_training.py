"""The product's promise: the same LoRA run gives the same losses and the same adapters at every
parallel layout (fp32, same data and seed, non-zero adapters after the first step), for LoRA and
for DoRA (magnitudes compared too), and for prefix tuning, plain and with its shared projection
(every layer's prefix compared). Without DoRA's row-norm all-reduce over row-parallel groups
the DoRA run at TP2xPP2xEP2+SP is off by up to 7.9e-3 in 6 of its 8 losses; without the sum of
the prefix projection's replicated gradients over TP x PP (lora/prefix.py,
reduce_shared_prefix_grads) 6 of 8 losses are off, by up to 2.6e-2 at PP2xEP2 and 3.4e-2 at
TP2xPP2xEP2+SP; and trainable tokens (with LoRA on attention): without the rows'
sequence_parallel mark (their TP sum under SP) 6 of 8 losses at TP2xPP2xEP2+SP are off (up to
4.8e-3)."""

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from megatron_lora.lora.model import LoraConfig, apply_lora
from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing import compare
from megatron_lora.testing.reference import save_weights
from megatron_lora.training.loop import train
from tests.harness import multirank
from tests.training import _support as S

# 8 steps of 4 sequences over 24: the data wraps into a second epoch (re-shuffled, re-split over
# the data-parallel ranks) at step 7, and the loss falls by ~0.24 (the check asks for 0.1).
STEPS = 8
SAMPLES = 24
# Dropout 0.1 on every adapter kind (attention, router, experts): the masks are keyed by (seed,
# iteration, global micro-batch, adapter), so every layout drops the same elements
# (lora/dropout.py); with keys drawn from the generators (the tensor-parallel RNG fork under SP,
# per-stage draws under PP, shared draws over DP) the step-2 losses already differ by ~1e-3.
LORA = LoraConfig(r=4, lora_alpha=8, seed=11, lora_dropout=0.1,
                  target_modules=["linear_qkv", "linear_proj", "router", "linear_fc1",
                                  "linear_fc2"])
# DoRA on every target it supports (attention and experts; not the router), the same dropout: its
# magnitudes are sharded like the base's output and its weight norms summed over row-parallel
# groups (lora/dora.py), which only a run at TP/ETP > 1 checks against one rank.
DORA = LoraConfig(r=4, lora_alpha=8, seed=11, lora_dropout=0.1, use_dora=True,
                  target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
# Prefix tuning (lora/prefix.py), plain and with the shared projection: its per-layer tensors
# are sharded by query groups over TP and held per stage, the projection's replicated part is
# summed over TP x PP by the finalize step (without that sum the TP2xPP2xEP2+SP losses are off
# from step 2), and every packed sample restarts at position n.
PREFIX = LoraConfig(num_virtual_tokens=4, target_modules=(), seed=11)
PREFIX_PROJ = LoraConfig(num_virtual_tokens=4, target_modules=(), seed=11,
                         prefix_projection=True, encoder_hidden_size=24)
# Trainable tokens (lora/trainable_tokens.py) with LoRA on attention: the rows of ids 256 and 257
# (every sample's first and last token) replicated [n, h], their gradients summed over TP under
# SP and over stages by nothing (the embedding and output layer sit on different stages).
TOKENS = LoraConfig(r=4, lora_alpha=8, seed=11, lora_dropout=0.1,
                    target_modules=["linear_qkv", "linear_proj"],
                    trainable_token_indices=(256, 257))
VARIANTS = {"lora": LORA, "dora": DORA, "prefix": PREFIX, "prefix_proj": PREFIX_PROJ,
            "tokens": TOKENS}
# How much the loss falls at least over the STEPS steps, and the learning rate (a prefix of 4
# tokens, initialised normal(0, 1) as PEFT does, needs a larger one).
TRAINS = {"lora": 0.1, "dora": 0.1, "prefix": 0.1, "prefix_proj": 0.1, "tokens": 0.1}
LR = {"lora": 3e-3, "dora": 3e-3, "prefix": 1e-1, "prefix_proj": 3e-2, "tokens": 3e-3}


def _optim(variant):
    return dataclasses.replace(S.optim(STEPS), lr=LR[variant])


def _lora_model(layout, weights=None, variant="lora"):
    model = S.model(layout, weights)
    adapters = apply_lora(model, VARIANTS[variant], verbose=False)
    return model, adapters


@multirank(world_size=1, timeout=300)
def _reference(directory, variant, layout=ParallelLayout()):
    model, adapters = _lora_model(layout, variant=variant)
    save_weights(model, os.path.join(directory, "weights"))  # base and initial adapters
    result = train([model], S.dataset(samples=SAMPLES), S.run_config(iters=STEPS),
                   _optim(variant), layout_name=layout.describe())
    tensors = S.global_adapters(adapters)
    tensors["losses"] = torch.tensor([result.losses[i] for i in range(1, STEPS + 1)])
    # The same run in fp64 from the same start: its losses against the fp32 run's are the
    # reference's own rounding (forward and trained adapters), see _loss_bound.
    model64, _ = _lora_model(layout, os.path.join(directory, "weights"), variant)
    model64.double()
    result64 = train([model64], S.dataset(samples=SAMPLES), S.run_config(iters=STEPS),
                     _optim(variant), layout_name=layout.describe())
    tensors["losses64"] = torch.tensor([result64.losses[i] for i in range(1, STEPS + 1)],
                                       dtype=torch.float64)
    save_file(tensors, os.path.join(directory, "reference.safetensors"))


def _loss_bound(reference):
    """Each step's loss is a mean over at most 4 x SEQ token cross-entropies of a forward
    through the adapters the previous steps trained: compare.mean_loss_bound from the reference's
    fp64 run (its forward and Adam steps rounded in another order; the fp32 reduction of the
    mean counted apart)."""
    return compare.mean_loss_bound(reference["losses"], reference["losses64"],
                                   S.run_config().global_batch_size * S.SEQ)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def lora_reference(request, tmp_path_factory):
    """(variant, folder of its one-rank run)."""
    directory = str(tmp_path_factory.mktemp(f"{request.param}_train_reference"))
    _reference(directory=directory, variant=request.param)
    return request.param, directory


# TP2+SP and EP2 alone are inside TP2xPP2xEP2+SP (their losses at every step against the one-rank
# run are also checked in tests/training/test_loop.py); 8 ranks on 2 cores is the suite's costliest
# world, so each layout here adds something the others do not.
CASES = [
    pytest.param(ParallelLayout(pp=2, ep=2), 4, id="PP2xEP2"),
    pytest.param(ParallelLayout(tp=2, pp=2, ep=2, sp=True), 8, id="TP2xPP2xEP2+SP"),
]


@pytest.mark.parametrize("layout,world_size", CASES)
@multirank(world_size=lambda world_size, **_: world_size, timeout=400)
def test_same_losses_and_same_adapters_at_every_layout(layout, world_size, lora_reference):
    variant, directory = lora_reference
    reference = load_file(os.path.join(directory, "reference.safetensors"))
    model, adapters = _lora_model(layout, os.path.join(directory, "weights"), variant)
    result = train([model], S.dataset(samples=SAMPLES), S.run_config(iters=STEPS),
                   _optim(variant), layout_name=layout.describe())
    losses = torch.tensor([result.losses[i] for i in range(1, STEPS + 1)])
    compare.assert_within(losses, reference["losses"], _loss_bound(reference),
                          f"{variant} losses at {layout.describe()}")
    assert losses[-1] < losses[0] - TRAINS[variant], losses  # it trains
    final = S.global_adapters(adapters)
    assert final and all(name in reference for name in final)
    for name, tensor in final.items():
        if name.endswith(".B"):
            assert tensor.abs().max() > 0  # B has moved away from its zero init
    S.assert_trained_like(final, reference, LR[variant], STEPS, f"{variant} at {layout.describe()}")
