"""One training step against plain autograd: the gradients, the grad norm and the clipped update
that `train()` applies are those of the global mean token loss, at world size 1 and at PP2xEP2.

The layout tests compare every layout with `train()` at world size 1, so a bug that is the same at
every layout (e.g. gradients divided by the token count twice: Adam's first step is nearly
scale-free) passes them. Here the reference is computed without the project's step or megatron's
schedule: one forward of the whole global batch at world size 1, the masked mean of
cross-entropy over every target token (docs/training.md), `.backward()`.
"""

import os
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from megatron_lora.lora import global_factors
from megatron_lora.lora.model import LoraConfig, apply_lora
from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing.reference import load_weights, save_weights
from megatron_lora.training import loop
from megatron_lora.training.optimizer import OptimConfig
from tests.harness import multirank
from tests.training import _support as S

LORA = LoraConfig(r=4, lora_alpha=8, seed=11,
                  target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
LR = 1e-2


def _global_names(adapters):
    return sorted(f"{name}.{f}" for name in adapters for f in "AB")


@multirank(world_size=1, timeout=300)
def _reference(directory, layout=ParallelLayout()):
    """Global weights with non-zero adapters, and plain-autograd gradients of the global mean loss
    of the first global batch."""
    model = S.model(layout)
    adapters = S.per_expert(apply_lora(model, LORA, verbose=False))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for ad in adapters.values():  # B starts at zero: make every factor's gradient non-zero
            ad.lora_B.copy_(torch.randn(ad.lora_B.shape, generator=g) * 0.05)
    save_weights(model, os.path.join(directory, "weights"))

    batch = S.dataset().batch(0, 4)
    mask = batch.loss_mask.float()
    assert 0 < mask.sum() < mask.numel()  # masked tokens exist: the count matters
    positions = torch.arange(S.SEQ).unsqueeze(0).expand_as(batch.tokens)
    logits = model(batch.tokens, positions, attention_mask=batch.attention_mask)  # [B, S, V]
    token_loss = F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(),
                                 reduction="none").view_as(mask)
    loss = (token_loss * mask).sum() / mask.sum()
    loss.backward()

    out = {"loss": loss.detach().reshape(1)}
    for name, ad in adapters.items():
        out[f"{name}.A"], out[f"{name}.B"] = global_factors(ad)
        out[f"grad/{name}.A"] = S.factor_grad(ad, "lora_A").detach().clone()
        out[f"grad/{name}.B"] = S.factor_grad(ad, "lora_B").detach().clone()
    grads = [v for k, v in out.items() if k.startswith("grad/")]
    norm = torch.sqrt(sum((v.double() ** 2).sum() for v in grads))
    assert all(v.abs().max() > 0 for v in grads)
    clip = norm / 4  # below the norm: the step must clip
    coeff = clip / (norm + 1e-6)  # megatron's clip coefficient
    # Adam's first step is p - lr * g / (|g| + eps): with eps near the clipped gradients' size
    # the update depends on their scale, so a wrong clip (or a wrong norm) shows in the update.
    eps = torch.cat([v.flatten() for v in grads]).abs().median() * coeff
    out.update(norm=norm.reshape(1).float(), clip=clip.reshape(1).float(),
               eps=eps.reshape(1).float())
    save_file(out, os.path.join(directory, "reference.safetensors"))


@pytest.fixture(scope="module")
def grad_reference(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("grad_reference"))
    _reference(directory=directory)
    return directory


def _expected_update(ref, name):
    g = ref[f"grad/{name}"].double()
    coeff = float(ref["clip"]) / (float(ref["norm"]) + 1e-6)
    return (-LR * (g * coeff) / ((g * coeff).abs() + float(ref["eps"]))).float()


def _capture_step(adapters, captured):
    """Wrap loop.wrap_for_training so that the optimizer's step records, per adapter, the reduced
    gradients it is given (DDP's main_grad), the reported grad norm, and the updated factors."""
    real = loop.wrap_for_training

    def wrap(chunks, optim):
        wrapped, optimizer, scheduler = real(chunks, optim)
        real_step = optimizer.step

        def step():
            for name, ad in adapters.items():
                grads = types.SimpleNamespace(geometry=ad.geometry,
                                              lora_A=S.factor_grad(ad, "lora_A"),
                                              lora_B=S.factor_grad(ad, "lora_B"))
                captured[f"grad/{name}.A"], captured[f"grad/{name}.B"] = global_factors(grads)
            ok, grad_norm, zeros = real_step()
            captured["grad_norm"] = grad_norm
            for name, ad in adapters.items():
                captured[f"{name}.A"], captured[f"{name}.B"] = global_factors(ad)
            return ok, grad_norm, zeros

        optimizer.step = step
        return wrapped, optimizer, scheduler

    return real, wrap


CASES = [
    pytest.param(ParallelLayout(), 1, id="world1"),
    pytest.param(ParallelLayout(pp=2, ep=2), 4, id="PP2xEP2"),
    # Expert-TP 1 under TP 2: replicated expert factors are duplicates over the expert-TP group
    # (size 1 here), not the dense TP group; counted by the dense one, a TP rank leaves its
    # experts' replicated factors out of the norm and clips by another factor.
    pytest.param(ParallelLayout(tp=2, etp=1, sp=True), 2, id="TP2xETP1+SP"),
    pytest.param(ParallelLayout(tp=2, ep=2, etp=1, sp=True), 4, id="TP2xEP2xETP1+SP"),
    # Expert-TP 2 under TP 1: counted by the dense group, both expert-TP ranks count them.
    pytest.param(ParallelLayout(ep=1, etp=2), 2, id="ETP2"),
]


@pytest.mark.parametrize("layout,world_size", CASES)
@multirank(world_size=lambda world_size, **_: world_size, timeout=400)
def test_a_step_applies_the_clipped_gradient_of_the_global_mean_loss(layout, world_size,
                                                                     grad_reference):
    ref = load_file(os.path.join(grad_reference, "reference.safetensors"))
    weights = os.path.join(grad_reference, "weights")
    model = S.model(layout, weights)
    adapters = S.per_expert(apply_lora(model, LORA, verbose=False))
    load_weights(model, weights)  # the reference's non-zero adapters
    captured = {}
    real, wrap = _capture_step(adapters, captured)
    loop.wrap_for_training = wrap
    try:
        optim = OptimConfig(lr=LR, lr_warmup_iters=0, lr_decay_style="constant", train_iters=1,
                            clip_grad=float(ref["clip"]), adam_eps=float(ref["eps"]))
        result = loop.train([model], S.dataset(), S.run_config(iters=1), optim,
                            layout_name=layout.describe())
    finally:
        loop.wrap_for_training = real
    assert result.losses[1] == pytest.approx(float(ref["loss"]), rel=1e-5)
    assert captured["grad_norm"] == pytest.approx(float(ref["norm"]), rel=1e-5)

    names = _global_names(adapters)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, names)
    # Every reference adapter is checked on some rank: no rank's share is silently empty.
    assert sorted(set(n for part in everyone for n in part)) == sorted(
        k for k in ref if not k.startswith("grad/") and k not in ("loss", "norm", "clip", "eps"))
    assert all(everyone)
    for name in names:
        grad = ref[f"grad/{name}"]
        torch.testing.assert_close(captured[f"grad/{name}"], grad, rtol=1e-4,
                                   atol=1e-5 * float(grad.abs().max()), msg=f"gradient of {name}")
        update = captured[name] - ref[name]
        expected = _expected_update(ref, name)
        torch.testing.assert_close(update, expected, rtol=1e-3, atol=LR * 1e-4,
                                   msg=f"update of {name}")
    # The check is sharp: without clipping the update would be visibly different.
    unclipped = {n: -LR * ref[f"grad/{n}"] / (ref[f"grad/{n}"].abs() + float(ref["eps"]))
                 for n in names}
    assert max(float((unclipped[n] - _expected_update(ref, n)).abs().max()) for n in names) > 0.1 * LR
