"""Activation recomputation (megatron's recompute_* settings) changes no number of LoRA training.

At TP2+SP (allgather dispatcher, rsLoRA) and PP2xEP2 (alltoall dispatcher), a tiny Mixtral with
non-zero LoRA adapters (A and B random) on linear_qkv, linear_proj, the router and every expert's
linear_fc1 / linear_fc2, dropout 0.1, fp32, runs one forward+backward of a global batch through
megatron's schedule (2 micro-batches per data-parallel replica, 1F1B under PP) without
recomputation, then with full/uniform, full/block and selective (core_attn + moe) recomputation
from the same weights and the same RNG states. Loss and the gradient of every adapter parameter
on every rank must be bit-identical: the recomputed forward replays the same kernels on the same
inputs with the same RNG states (so the same activations), the backward of each region runs the
same kernels on them, and each adapter parameter is used once per micro-batch, so its .grad
receives the same terms in the same order (one per micro-batch) with or without recomputation
(deterministic kernels, as on the CPU ranks). The one exception is a parameter shared by every
layer (prefix tuning's encoder, see _shared_bounds). Every adapter's gradient is non-zero (a
frozen embedding would leave the first checkpointed chunk without any, see models/recompute.py),
each run recomputes exactly the expected number of regions, and a control run whose
recomputation restores another LoRA dropout key (lora/dropout.py keeps the micro-batch's key in
megatron's RNG tracker, which recomputation saves and restores) differs.
"""

import argparse
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import random as mrandom

from megatron_lora.lora.dropout import MICRO_BATCH_KEY
from megatron_lora.lora.model import LoraConfig, apply_lora
from megatron_lora.models.gpt import build_gpt_model, tiny_moe_shape, transformer_config
from megatron_lora.models.recompute import (
    recompute_overrides,
    recompute_problems,
    recomputes_parameters,
)
from megatron_lora.runtime import ParallelLayout, cpu_compat
from megatron_lora.testing import compare
from megatron_lora.training.step import forward_backward
from tests.harness import multirank

SHAPE = tiny_moe_shape()  # 4 layers, h 64, 4 experts top-2, GQA
SEQ = 16
MICRO_BATCHES = 2  # per data-parallel replica, micro-batch size 1

RECOMPUTE = {
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=2),
    "full_block": dict(recompute_granularity="full", recompute_method="block",
                       recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe"]),
}


def _expected_recomputations(name, layers_per_stage, micro_batches):
    per_micro = {"full_uniform": layers_per_stage // 2, "full_block": 1,
                 "selective": 2 * layers_per_stage}[name]
    return per_micro * micro_batches


def _lora(rslora: bool) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.1, init_lora_weights=False, seed=3,
                      use_rslora=rslora, rank_pattern={"experts": 2},
                      target_modules=["linear_qkv", "linear_proj", "router", "linear_fc1",
                                      "linear_fc2"])


def _batch(dp: int):
    g = torch.Generator().manual_seed(21)
    rows = torch.randint(0, SHAPE.vocab_size, (MICRO_BATCHES * dp, SEQ + 1), generator=g)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


@contextlib.contextmanager
def _counting_recomputations(counter):
    """Count CheckpointFunction.backward calls: each recomputes one checkpointed region."""
    real = mrandom.CheckpointFunction.backward

    def backward(ctx, *grads):
        counter[0] += 1
        return real(ctx, *grads)

    mrandom.CheckpointFunction.backward = staticmethod(backward)
    try:
        yield
    finally:
        mrandom.CheckpointFunction.backward = staticmethod(real)


@contextlib.contextmanager
def _other_masks_when_recomputing():
    """The control: recomputation restores the RNG states, but with another LoRA micro-batch key
    (lora/dropout.py) in the tracker's, so the recomputed forward draws other dropout masks."""
    real = mrandom._set_all_rng_states

    def restore(cpu, cuda, tracker):
        tracker = dict(tracker)
        key = tracker.get(MICRO_BATCH_KEY)
        if key is not None:
            tracker[MICRO_BATCH_KEY] = key + torch.tensor([1, 0, 0])
        return real(cpu, cuda, tracker)

    mrandom._set_all_rng_states = restore
    try:
        yield
    finally:
        mrandom._set_all_rng_states = real


def _run(layout, dispatcher, lora, weights, rng_states, overrides, wrap=None):
    """(loss, {adapter param name: grad}, adapter param names, recomputations) of one
    forward+backward of the global batch from `weights` and `rng_states`."""
    from megatron.core import parallel_state as ps

    config = transformer_config(SHAPE, layout, dispatcher=dispatcher, **overrides)
    model = build_gpt_model(SHAPE, config)
    apply_lora(model, lora, verbose=False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    cpu, cuda, tracker = rng_states
    mrandom._set_all_rng_states(cpu, cuda, dict(tracker))  # the tracker keeps (and moves) the dict
    tokens, labels = _batch(ps.get_data_parallel_world_size())
    counter = [0]
    with _counting_recomputations(counter), (wrap or contextlib.nullcontext)():
        loss = forward_backward([model], tokens, labels, micro_batch_size=1)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
             if p.requires_grad and p.grad is not None}
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    return loss, grads, adapters, counter[0]


def _worst(grads, ref):
    """max over this rank's adapter parameters of |g - g_ref| / max|g_ref| (all-reduced max)."""
    worst = max((float((grads[n] - g).abs().max()) / float(g.abs().max()) for n, g in ref.items()),
                default=0.0)
    t = torch.tensor([worst])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


CASES = [
    pytest.param(ParallelLayout(tp=2, sp=True), 2, "allgather", True, id="TP2+SP"),
    pytest.param(ParallelLayout(pp=2, ep=2), 4, "alltoall", False, id="PP2xEP2"),
]


@pytest.mark.parametrize("layout,world_size,dispatcher,rslora", CASES)
@multirank(world_size=lambda world_size, **_: world_size, timeout=300)
def test_recomputed_gradients_equal_those_without(layout, world_size, dispatcher, rslora):
    lora = _lora(rslora)
    rng_states = mrandom._get_all_rng_states()
    base = build_gpt_model(SHAPE, transformer_config(SHAPE, layout, dispatcher=dispatcher))
    apply_lora(base, lora, verbose=False)
    weights = {n: p.detach().clone() for n, p in base.named_parameters()}
    del base
    ref_loss, ref, adapters, none = _run(layout, dispatcher, lora, weights, rng_states, {})
    assert none == 0
    # Every adapter parameter of this rank has a non-zero gradient, and every rank holds some.
    assert adapters and sorted(ref) == sorted(adapters)
    assert all(float(g.abs().max()) > 0 for g in ref.values())
    assert any("lora" in n and "router" in n for n in adapters)
    assert any("experts" in n for n in adapters)

    layers_per_stage = SHAPE.num_layers // layout.pp
    for name, overrides in RECOMPUTE.items():
        loss, grads, _, count = _run(layout, dispatcher, lora, weights, rng_states, overrides)
        assert count == _expected_recomputations(name, layers_per_stage, MICRO_BATCHES), (
            name, count)
        assert float(loss) == float(ref_loss), (name, float(loss), float(ref_loss))
        assert sorted(grads) == sorted(ref), f"{name}: adapters without a gradient"
        for n, g in ref.items():  # the same terms in the same order: bit-identical
            compare.assert_within(grads[n], g, 0.0, f"{name}: gradient of {n}")
        assert _worst(grads, ref) == 0.0, name  # on every rank

    # Control: a recomputed forward with other dropout masks than its forward fails the equality
    # above (by about the share of dropped inputs, i.e. far beyond any rounding).
    _, grads, _, count = _run(layout, dispatcher, lora, weights, rng_states,
                              RECOMPUTE["full_uniform"], wrap=_other_masks_when_recomputing)
    assert count > 0
    assert _worst(grads, ref) > 0.0


def _shared_bounds(layout, lora, weights, rng_states):
    """{parameter name: per-element bound} for the parameters used by more than one call per
    micro-batch (prefix tuning's shared encoder E, W1, b1: every layer calls it). Their gradient
    is the sum of one term per call, each term bit-identical with or without recomputation; but
    a recomputed region's terms reach .grad in a backward call of their own while autograd sums
    the others first, so the terms are added in another association: at most
    sum_rounding_bound(fp32, calls, sum over calls of |term|) apart. The terms are measured in a
    run where each call uses leaf copies of the parameters."""
    from megatron_lora.lora.prefix import PrefixEncoder

    calls = []
    real = PrefixEncoder.forward

    def forward(self):
        leaves = {n: p.detach().clone().requires_grad_() for n, p in self.named_parameters()}
        calls.append(leaves)
        return torch.tanh(F.linear(leaves["embedding"], leaves["weight"], leaves["bias"]))

    PrefixEncoder.forward = forward
    try:
        _run(layout, "allgather", lora, weights, rng_states, {})
    finally:
        PrefixEncoder.forward = real
    if not calls:
        return {}
    bounds = {}
    for n in calls[0]:
        abs_sum = sum(c[n].grad.abs() for c in calls)
        bounds[f"prefix_encoder.{n}"] = compare.sum_rounding_bound(torch.float32, len(calls),
                                                                   1.0) * abs_sum
    return bounds


def _same_gradients_with_recomputation(layout, lora, recomputations, control):
    """One-rank run of `lora` without recomputation, then with each of `recomputations`: the same
    loss and bit-identical gradients (those of a shared prefix encoder within _shared_bounds),
    every adapter parameter's non-zero. Returns the gradients of a run with `control`
    recomputation when require_decoder_input_grad does nothing."""
    from megatron_lora.lora import input_grad

    rng_states = mrandom._get_all_rng_states()
    base = build_gpt_model(SHAPE, transformer_config(SHAPE, layout))
    apply_lora(base, lora, verbose=False)
    weights = {n: p.detach().clone() for n, p in base.named_parameters()}
    del base
    ref_loss, ref, adapters, _ = _run(layout, "allgather", lora, weights, rng_states, {})
    assert sorted(ref) == sorted(adapters) and all(float(g.abs().max()) > 0 for g in ref.values())
    shared = _shared_bounds(layout, lora, weights, rng_states)
    assert set(shared) <= set(ref), (sorted(shared), sorted(ref))
    for overrides in recomputations:
        loss, grads, _, count = _run(layout, "allgather", lora, weights, rng_states, overrides)
        assert count > 0 and float(loss) == float(ref_loss), (float(loss), float(ref_loss))
        assert sorted(grads) == sorted(ref)
        for n, g in ref.items():
            compare.assert_within(grads[n], g, shared.get(n, 0.0),
                                  f"{overrides}: gradient of {n}")
    real = input_grad.require_decoder_input_grad
    input_grad.require_decoder_input_grad = lambda model: False
    try:
        _, grads, _, count = _run(layout, "allgather", lora, weights, rng_states, control)
    finally:
        input_grad.require_decoder_input_grad = real
    return grads, count, adapters


@multirank(world_size=1, timeout=300)
def test_expert_only_adapters_get_their_gradients(layout=ParallelLayout()):
    """LoRA on the experts alone: no MoE layer's input requires grad (each recomputed MoE
    region's output would not either), so without require_decoder_input_grad no expert adapter
    gets a gradient."""
    lora = LoraConfig(r=4, lora_alpha=8.0, lora_dropout=0.1, init_lora_weights=False, seed=5,
                      target_modules=["linear_fc1", "linear_fc2"])
    selective_moe = dict(recompute_granularity="selective", recompute_modules=["moe"])
    grads, _, _ = _same_gradients_with_recomputation(
        layout, lora, (RECOMPUTE["full_block"], selective_moe), selective_moe)
    # Control: without the hook no adapter gets a gradient, and nothing says so.
    assert grads == {}, sorted(grads)


# ---------------------------------------------------------------------------------------------
# The CPU fixes recomputation needs, at the megatron call sites.
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU fixes are inactive with CUDA")
@multirank(world_size=1)
def test_cpu_recomputation_restores_the_generator_and_the_device_mode():
    from megatron.core.transformer.utils import get_default_causal_mask

    assert cpu_compat.installed()["recompute_rng"] and cpu_compat.installed()["recompute_device"]
    with pytest.raises(Exception):
        cpu_compat.ORIGINALS["recompute_rng"]()  # megatron's call asks torch.cuda
    x = torch.randn(6, 6, requires_grad=True)

    def region(t):  # a hard-coded device="cuda" and a CPU generator draw, as in megatron layers
        mask = get_default_causal_mask(6)
        return (t.masked_fill(mask, 0.0) * torch.rand(6, 6)).sum(0)

    state = torch.get_rng_state()
    region(x).sum().backward()
    plain = x.grad.clone()
    x.grad = None
    torch.set_rng_state(state)
    mrandom.checkpoint(region, False, x).sum().backward()  # recomputed inside backward
    assert torch.equal(x.grad, plain)


# ---------------------------------------------------------------------------------------------
# Settings checks (pure, as `megatron-lora train` runs them on every rank before any collective).
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings,needle", [
    ((None, "block", None, None), "--recompute-method applies to --recompute-granularity full"),
    (("selective", None, 2, None), "--recompute-num-layers applies to --recompute-granularity "
                                   "full only (got --recompute-granularity selective)"),
    (("full", None, 2, None), "--recompute-granularity full needs --recompute-method"),
    (("full", "block", None, None), "needs --recompute-num-layers N, 1 <= N <= 2"),
    (("full", "block", 3, None), "--recompute-num-layers 3 must be in [1, 2]"),
    (("full", "uniform", 0, None), "--recompute-num-layers 0 must be in [1, 2]"),
    (("full", "block", 1, ["moe"]), "--recompute-modules applies to --recompute-granularity "
                                    "selective only"),
    (("selective", None, None, ["layernorm"]), "--recompute-modules layernorm: not available"),
    (("selective", None, None, ["mlp"]), "--recompute-modules mlp: not available"),
    (("selective", None, None, ["attn"]), "--recompute-modules 'attn': unknown; choose from "
                                          "core_attn, moe"),
])
def test_bad_settings_name_the_flag(settings, needle):
    problems = recompute_problems(*settings, layers_per_stage=2)
    assert any(needle in p for p in problems), problems


def test_uniform_chunks_must_divide_the_stage():
    (problem,) = recompute_problems("full", "uniform", 3, None, layers_per_stage=4)
    assert "--recompute-num-layers 3 does not divide the 4 layers" in problem
    assert recompute_problems("full", "block", 3, None, layers_per_stage=4) == []


@pytest.mark.parametrize("settings", [
    (None, None, None, None), ("full", "uniform", 2, None), ("full", "block", 1, None),
    ("selective", None, None, None), ("selective", None, None, ["core_attn", "moe"]),
])
def test_good_settings_make_a_megatron_config(settings):
    assert recompute_problems(*settings, layers_per_stage=2) == []
    config = transformer_config(SHAPE, ParallelLayout(), **recompute_overrides(*settings))
    assert config.recompute_granularity == settings[0]
    assert config.recompute_method == settings[1]
    assert config.recompute_num_layers == settings[2]
    assert recomputes_parameters(config) == (settings[0] == "full" or bool(settings[3]))


def test_train_parses_the_flags():
    from megatron_lora.cli import build_parser

    base = ["train", "--load-hf", "x", "--data-path", "d", "--tokenizer", "byte",
            "--seq-length", "8", "--global-batch-size", "1", "--train-iters", "1"]
    args = build_parser().parse_args(base + [
        "--recompute-granularity", "full", "--recompute-method", "block",
        "--recompute-num-layers", "2"])
    assert (args.recompute_granularity, args.recompute_method, args.recompute_num_layers,
            args.recompute_modules) == ("full", "block", 2, None)
    args = build_parser().parse_args(base + ["--recompute-granularity", "selective",
                                             "--recompute-modules", "core_attn", "moe"])
    assert args.recompute_modules == ["core_attn", "moe"]
    assert isinstance(args, argparse.Namespace)


@multirank(world_size=1, timeout=300)
def test_prefix_tuning_gets_its_gradients_through_recomputed_attention(layout=ParallelLayout()):
    """Prefix tuning (lora/prefix.py, with its shared projection) lives inside the core
    attention, which selective recomputation of core_attn alone checkpoints: with the frozen base
    nothing entering it requires grad, so unless apply_prefix makes the decoder input require
    grad the prefix gets no gradient (the control below). Full and core_attn-only recomputation
    give the gradients of the run without."""
    prefix = LoraConfig(num_virtual_tokens=3, target_modules=(), prefix_projection=True,
                        encoder_hidden_size=8, seed=5)
    core_attn = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    grads, count, adapters = _same_gradients_with_recomputation(
        layout, prefix, (RECOMPUTE["full_block"], core_attn), core_attn)
    assert any("prefix_encoder" in n for n in adapters)
    # The control: no prefix parameter got a gradient (and no checkpointed region was even
    # recomputed, since no output of one required grad).
    assert count == 0 and not grads, {n: float(g.abs().max()) for n, g in grads.items()}
