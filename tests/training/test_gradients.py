"""One training step against plain autograd: the gradients, the grad norm and the clipped update
that `train()` applies are those of the global mean token loss, at world size 1 and at PP2xEP2.

The layout tests compare every layout with `train()` at world size 1, so a bug that is the same at
every layout (e.g. gradients divided by the token count twice: Adam's first step is nearly
scale-free) passes them. Here the reference is computed without the project's step or megatron's
schedule: one forward of the whole global batch at world size 1, the masked mean of
cross-entropy over every target token (docs/training.md), `.backward()`.

The bounds come from the reference's own rounding: the same reference evaluated in fp64 (the
model `.double()`, the same weights and batch) gives e = max |ref32 - ref64| per compared
quantity, and ours (another fp32 evaluation order of the same real computation) is within
(K + 1) e of the fp32 reference (compare.reference_bound). The loss, the grad norm and the
clipped Adam update are bounded from those (_loss_bound, _norm_bound, _update_bound).
"""

import math
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
from megatron_lora.testing import compare
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
    token_loss, loss = _mean_loss(model, batch)
    loss.backward()
    # The same reference in fp64 (same weights, same batch): its distance to the fp32 one is the
    # reference's own rounding, from which every bound below follows.
    model64 = S.model(layout)
    adapters64 = S.per_expert(apply_lora(model64, LORA, verbose=False))
    load_weights(model64, os.path.join(directory, "weights"))
    model64.double()
    token_loss64, loss64 = _mean_loss(model64, batch)
    loss64.backward()

    keep = batch.loss_mask.flatten().bool()
    out = {"loss": loss.detach().reshape(1), "token_loss": token_loss.flatten()[keep].detach(),
           "token_loss64": token_loss64.flatten()[keep].detach()}
    for name, ad in adapters.items():
        out[f"{name}.A"], out[f"{name}.B"] = global_factors(ad)
        out[f"grad/{name}.A"] = S.factor_grad(ad, "lora_A").detach().clone()
        out[f"grad/{name}.B"] = S.factor_grad(ad, "lora_B").detach().clone()
        out[f"grad64/{name}.A"] = S.factor_grad(adapters64[name], "lora_A").detach().clone()
        out[f"grad64/{name}.B"] = S.factor_grad(adapters64[name], "lora_B").detach().clone()
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


def _mean_loss(model, batch):
    """(per-token cross-entropy [B, S], its masked mean) in the model's dtype."""
    dtype = next(model.parameters()).dtype
    mask = batch.loss_mask.to(dtype)
    positions = torch.arange(S.SEQ).unsqueeze(0).expand_as(batch.tokens)
    logits = model(batch.tokens, positions, attention_mask=batch.attention_mask)  # [B, S, V]
    token_loss = F.cross_entropy(logits.to(dtype).flatten(0, 1), batch.labels.flatten(),
                                 reduction="none").view_as(mask)
    return token_loss, (token_loss * mask).sum() / mask.sum()


@pytest.fixture(scope="module")
def grad_reference(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("grad_reference"))
    _reference(directory=directory)
    return directory


def _expected_update(ref, name):
    g = ref[f"grad/{name}"].double()
    coeff = float(ref["clip"]) / (float(ref["norm"]) + 1e-6)
    return (-LR * (g * coeff) / ((g * coeff).abs() + float(ref["eps"]))).float()


def _grad_bound(ref, name):
    """|our gradient - the fp32 reference's| per element of `name` (compare.reference_bound)."""
    return compare.reference_bound(ref[f"grad/{name}"], ref[f"grad64/{name}"])


def _loss_bound(ref):
    """Per token, ours is within (K + 1) e of the fp32 reference (e: the reference's fp32
    rounding of its per-token losses, compare.reference_bound), so their means are too; the two
    masked means sum the same T positive terms in other orders (Higham and Mary: at most
    lam sqrt(T) u of their sum each, compare.gradient_bound with cancellation 1)."""
    tokens = ref["token_loss"]
    return (compare.reference_bound(tokens, ref["token_loss64"])
            + compare.gradient_bound(ref["loss"], tokens.numel(), cancellation=1.0))


def _norm_bound(ref):
    """Ours against the reference's norm (of its fp32 gradients, summed in fp64). With d the
    per-element gradient bounds, g_ours = g_ref + D, |D_i| <= d_i:
    | ||g_ours|| - ||g_ref|| | = |2 <g_ref, D> + ||D||**2| / (||g_ours|| + ||g_ref||)
    <= (2 sum |g_ref| d + sum d**2) / (2 ||g_ref|| - ||d||). Ours sums the squares in fp32
    (training/grad_norm.py: each tensor's, then the tensors', then the parts' and ranks'): an
    element's square passes through at most (the largest tensor + the tensors + 8) additions, so
    two orders of the sum of squares differ by gradient_bound(norm**2, that, 1), which moves the
    norm by that / (2 norm); its three square roots and three squares round by u each."""
    u = compare.unit_roundoff(torch.float32)
    grads = {k[len("grad/"):]: v.double() for k, v in ref.items() if k.startswith("grad/")}
    norm = float(ref["norm"])
    cross = sum(float((g.abs() * _grad_bound(ref, n)).sum()) for n, g in grads.items())
    square = sum(g.numel() * _grad_bound(ref, n) ** 2 for n, g in grads.items())
    spread = (2 * cross + square) / (2 * norm - math.sqrt(square))
    chain = max(g.numel() for g in grads.values()) + len(grads) + 8
    rounding = compare.gradient_bound(torch.tensor(norm ** 2), chain, cancellation=1.0)
    return spread + rounding / (2 * norm) + 6 * u * norm


def _update_bound(ref, name, param, dn):
    """Per element of `name`: Adam's first step is -lr f(x), f(x) = x / (|x| + eps), x = g c the
    clipped gradient (c = clip / (norm + 1e-6)). Ours has x within dx = c (dg + |g| dn / norm)
    + u |x| (dg, dn the gradient and norm bounds; the clip's own rounding), and
    |f'| = eps / (|x| + eps)**2 is largest where |x| is smallest, so f moves by at most
    eps dx / (max(|x| - dx, 0) + eps)**2; Adam's moments, bias corrections, sqrt, eps, division
    and lr round the step by about 8 u relative, adding it to the fp32 parameter rounds by
    u |param|, and the test's difference of two parameters by u |update|."""
    u = compare.unit_roundoff(torch.float32)
    g = ref[f"grad/{name}"].double()
    norm, eps = float(ref["norm"]), float(ref["eps"])
    coeff = float(ref["clip"]) / (norm + 1e-6)
    x = g * coeff
    dx = coeff * (_grad_bound(ref, name) + g.abs() * dn / norm) + u * x.abs()
    step = (-LR * x / (x.abs() + eps)).abs()
    df = eps * dx / ((x.abs() - dx).clamp_min(0) + eps) ** 2
    return LR * df + 8 * u * step + u * param.detach().double().abs() + u * step


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
    loss = torch.tensor([result.losses[1]])
    compare.assert_within(loss, ref["loss"], _loss_bound(ref), "loss")
    names = _global_names(adapters)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, names)
    # Every reference adapter is checked on some rank: no rank's share is silently empty.
    assert sorted(set(n for part in everyone for n in part)) == sorted(
        k for k in ref if not k.startswith(("grad/", "grad64/"))
        and k not in ("loss", "norm", "clip", "eps", "token_loss", "token_loss64"))
    assert all(everyone)
    norm_bound = _norm_bound(ref)
    for name in names:
        compare.assert_within(captured[f"grad/{name}"], ref[f"grad/{name}"],
                              _grad_bound(ref, name), f"gradient of {name}")
        compare.assert_within(captured[name] - ref[name], _expected_update(ref, name),
                              _update_bound(ref, name, captured[name], norm_bound),
                              f"update of {name}")
    compare.assert_within(torch.tensor([float(captured["grad_norm"])]), ref["norm"],
                          norm_bound, "grad norm")
    # The check is sharp: without clipping the update would be visibly different.
    unclipped = {n: -LR * ref[f"grad/{n}"] / (ref[f"grad/{n}"].abs() + float(ref["eps"]))
                 for n in names}
    assert max(float((unclipped[n] - _expected_update(ref, n)).abs().max()) for n in names) > 0.1 * LR
