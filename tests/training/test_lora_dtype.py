"""Half-precision adapters in training (train --lora-dtype): bf16 parameters and gradient buffers,
fp32 master weights and Adam moments in megatron's optimizer, the same run at TP2+SP, PP2xEP2 and
TP2xPP2xEP2+SP as at one rank (within bf16 rounding), checkpoints and PEFT exports in bf16, and
an exact resume.

The base model stays fp32 here (CPU); only the adapters are bf16, so every difference between the
layouts comes from rounding the bf16 parameters and gradients."""

import dataclasses
import json
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_lora.lora.model import LoraConfig, apply_lora
from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing import compare
from megatron_lora.testing.reference import save_weights
from tests.harness import multirank
from tests.training import _support as S

STEPS = 4
# Non-zero B from the start (init_lora_weights=False): every factor has a gradient at step 1.
# No adapter dropout in the cross-layout run (dropout > 0 is covered against plain torch in
# tests/lora/test_lora_dtype.py and by the exact bf16 resume below).
LORA = LoraConfig(r=4, lora_alpha=8, seed=11, dtype="bf16", init_lora_weights=False,
                  target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
# Each layout against one rank, bf16 adapters on an fp32 base. The forward runs in fp32 on the
# bf16 factors' values; the gradients are rounded to bf16 (accumulated over 4 micro-batches in
# the bf16 buffer, summed over TP in bf16 under SP) and each step's parameters are the fp32
# masters rounded to bf16. The reference also runs without any bf16 (fp64, from the same bf16
# start): its distance to that run is what its roundings did, and another layout's roundings
# (the same kinds, in another order) are within compare.reference_bound of it: elementwise for
# the step-1 gradients (K + 1 = 11 times the reference's worst element error, which holds the
# bf16 rounding of its large elements, so a tiny element several ulps off stays inside).
# Losses: each a mean over the step's tokens of fp32 cross-entropies through the adapters the
# previous steps trained; the reference's bf16 trajectory is off the fp64 one (3.2e-4 over 4
# steps on losses of ~5.9), and another layout's roundings of the same kinds are within
# compare.mean_loss_bound of it (3.6e-3, 6.1e-4 relative). That is too loose for the missing SP
# gradient sum below (4e-4 relative at step 4: the layouts agree far closer, <= 6.6e-6 relative
# measured, because both round nearly equal masters to the same bf16 values), which the step-1
# gradients catch instead (and the adapters' Adam bounds).
# Without the SP gradient sum of the replicated factors (broken=True) the gradient check fails.


def check_half_adapters(adapters, optimizer, dtype=torch.bfloat16) -> int:
    """Every adapter parameter and its DDP gradient are `dtype`; the optimizer's master copy of
    each is fp32 and the parameter is exactly that master rounded to `dtype`, while the master
    holds what `dtype` cannot show (it moved by less than one ulp somewhere). Returns how many
    parameters were checked. Raises AssertionError naming what is wrong."""
    from megatron_lora.training.checkpoint import _param_pairs

    ids = {id(p) for ad in adapters.values() for p in ad.parameters() if p.requires_grad}
    checked, finer = 0, 0
    for inner, model_p, main_p in _param_pairs(optimizer):
        if id(model_p) not in ids:
            continue
        assert model_p.dtype == dtype, f"adapter parameter in {model_p.dtype}, not {dtype}"
        assert model_p.main_grad.dtype == dtype, f"gradient buffer in {model_p.main_grad.dtype}"
        assert main_p is not model_p and main_p.dtype == torch.float32, (
            f"master weight in {main_p.dtype}: not an fp32 master copy")
        assert torch.equal(model_p, main_p.to(dtype)), "parameter != master rounded"
        for name in ("exp_avg", "exp_avg_sq"):
            assert inner.state[main_p][name].dtype == torch.float32, name
        finer += int((main_p - model_p.float()).abs().max() > 0)
        checked += 1
    assert checked == len(ids), f"{checked} of {len(ids)} adapter parameters in the optimizer"
    assert finer > 0, "no master differs from its bf16 parameter: the masters are not fp32"
    return checked


def _global_grads(adapters) -> dict:
    """{name.A/B: the global gradient of the factor} in its DDP buffer (fp32 copies)."""
    from types import SimpleNamespace

    from megatron_lora.lora import global_factors

    out = {}
    for name, ad in S.per_expert(adapters).items():
        grads = SimpleNamespace(geometry=ad.geometry, lora_A=S.factor_grad(ad, "lora_A"),
                                lora_B=S.factor_grad(ad, "lora_B"))
        a, b = global_factors(grads)
        out[f"{name}.A.grad"], out[f"{name}.B.grad"] = a.float(), b.float()
    return out


def _steps(model, steps, optim, adapters=None):
    """`steps` training steps of the loop's kind; returns (losses, optimizer, the global adapter
    gradients of step 1 (with `adapters`)); the optimizer's `wrapped_chunks` and `scheduler`
    attributes are the DDP chunks and the scheduler, for a checkpoint."""
    from megatron_lora.training.optimizer import wrap_for_training
    from megatron_lora.training.step import forward_backward

    wrapped, optimizer, scheduler = wrap_for_training([model], optim)
    torch.manual_seed(1234)  # the dropout keys come from the default generator: same draws
    data, run = S.dataset(samples=16), S.run_config(iters=steps)
    losses, grads = [], {}
    for i in range(steps):
        batch = data.batch(i * run.global_batch_size, run.global_batch_size)
        wrapped[0].zero_grad_buffer()
        optimizer.zero_grad()
        loss = forward_backward(wrapped, batch.tokens, batch.labels, batch.loss_mask,
                                micro_batch_size=run.micro_batch_size)
        if i == 0 and adapters is not None:
            grads = _global_grads(adapters)
        ok, _, _ = optimizer.step()
        assert ok
        scheduler.step(increment=1)
        losses.append(float(loss))
    optimizer.wrapped_chunks, optimizer.scheduler = wrapped, scheduler
    return torch.tensor(losses, dtype=torch.float64), optimizer, grads


@multirank(world_size=1, timeout=300)
def _reference(directory, layout=ParallelLayout()):
    model = S.model(layout)
    save_weights(model, os.path.join(directory, "weights"))
    adapters = apply_lora(model, LORA, verbose=False)
    start = {k: v.float() for k, v in S.global_adapters(adapters).items()}
    losses, optimizer, grads = _steps(model, STEPS, S.optim(STEPS), adapters)
    check_half_adapters(adapters, optimizer)
    tensors = {k: v.float() for k, v in S.global_adapters(adapters).items()}
    tensors.update(grads)
    tensors["losses"] = losses
    # The same run without bf16 (adapters in the base's dtype, everything fp64) from the same
    # start (the bf16 factors' values): what the reference's bf16 roundings (gradients, their
    # buffer) and fp32 roundings did to its step-1 gradients, the scale of another layout's
    # (compare.reference_bound).
    model64 = S.model(layout, os.path.join(directory, "weights"))
    adapters64 = apply_lora(model64, dataclasses.replace(LORA, dtype=None), verbose=False)
    with torch.no_grad():
        for ad in adapters64.values():
            for p in ad.parameters():
                p.copy_(p.to(torch.bfloat16))
    twin = S.global_adapters(adapters64)
    assert twin.keys() == start.keys()
    for k, v in twin.items():
        assert torch.equal(v.float(), start[k]), f"{k}: the fp64 run starts elsewhere"
    model64.double()
    losses64, _, grads64 = _steps(model64, STEPS, S.optim(STEPS), adapters64)
    tensors.update({f"{k}64": v for k, v in grads64.items()})
    tensors["losses64"] = losses64.double()
    save_file(tensors, os.path.join(directory, "reference.safetensors"))


@pytest.fixture(scope="module")
def bf16_reference(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("bf16_reference"))
    _reference(directory=directory)
    return directory


@pytest.mark.parametrize("layout,world_size,broken", [
    pytest.param(ParallelLayout(tp=2, sp=True), 2, False, id="TP2+SP-exact"),
    pytest.param(ParallelLayout(tp=2, sp=True), 2, True, id="TP2+SP-no-sp-grad-sum"),
    pytest.param(ParallelLayout(pp=2, ep=2), 4, False, id="PP2xEP2-exact"),
    pytest.param(ParallelLayout(tp=2, pp=2, ep=2, sp=True), 8, False,
                 id="TP2xPP2xEP2+SP-exact"),
])
@multirank(world_size=lambda world_size, **_: world_size, timeout=300)
def test_bf16_adapters_match_one_rank(layout, world_size, broken, bf16_reference):
    """broken: the replicated factors' partial gradients under SP (each rank's tokens) are not
    summed over TP (their `sequence_parallel` mark removed): the gradient check must fail."""
    reference = load_file(os.path.join(bf16_reference, "reference.safetensors"))
    model = S.model(layout, os.path.join(bf16_reference, "weights"))
    adapters = apply_lora(model, LORA, verbose=False)
    if broken:
        for ad in adapters.values():
            for p in ad.parameters():
                p.sequence_parallel = False
    losses, optimizer, grads = _steps(model, STEPS, S.optim(STEPS), adapters)

    def check_grads():
        assert grads and all(g.abs().max() > 0 for g in grads.values())
        for name, g in grads.items():
            want = reference[name]
            compare.assert_within(g, want, compare.reference_bound(want, reference[f"{name}64"]),
                                  f"step-1 gradient {name} at {layout.describe()}")

    def check_losses():
        run = S.run_config(iters=STEPS)
        bound = compare.mean_loss_bound(reference["losses"], reference["losses64"],
                                        run.global_batch_size * S.SEQ)
        compare.assert_within(losses, reference["losses"], bound,
                              f"losses at {layout.describe()} (compare.mean_loss_bound)")

    if broken:
        with pytest.raises(AssertionError, match="step-1 gradient"):
            check_grads()
        return
    check_grads()
    check_losses()
    assert check_half_adapters(adapters, optimizer) > 0
    assert losses[-1] < losses[0]  # it trains
    final = S.global_adapters(adapters)
    for name, tensor in final.items():
        assert tensor.dtype == torch.bfloat16
        if name.endswith(".B"):
            assert tensor.abs().max() > 0
    # Adam (fp32 masters, bf16 gradients): every element within Adam's bound (2 x lr per step,
    # 0.024), where a gradient cancels it may go either way. Elsewhere the gradients of the two
    # layouts differ by <= 6 bf16 roundings (4 micro-batches, the TP sum, the cast: 6 x 2**-8)
    # times 4 (terms adding up to <= 4x the gradient): rho = 9.4 %, which moves the master by
    # rho x 0.024 = 2.3e-3, and each run rounds its master to bf16 (1 ulp each, 2**-7 of |x|)
    lrs = [S.optim(STEPS).lr] * STEPS
    rho = 6 * compare.unit_roundoff(torch.bfloat16) * 4

    def tight(want):
        return rho * compare.adam_step_bound(lrs) + 2 ** -7 * want.abs()

    compare.assert_adam_trained_close({n: t.float() for n, t in final.items()},
                                      {n: reference[n] for n in final}, lrs, tight,
                                      f"bf16 adapters at {layout.describe()}")


@pytest.mark.parametrize("layout", [ParallelLayout()], ids=["TP1"])
@multirank(world_size=1, timeout=300)
def test_master_check_fails_with_bf16_precision_masters(layout):
    """The master check is not vacuous: masters that hold no more than bf16 (rounded to bf16
    after the step, as bf16 masters would be) fail it; the same optimizer passed before."""
    from megatron_lora.training.checkpoint import _param_pairs

    model = S.model(layout)
    adapters = apply_lora(model, LORA, verbose=False)
    _, optimizer, _ = _steps(model, 2, S.optim(2))  # step 1 is warmup at lr 0
    assert check_half_adapters(adapters, optimizer) > 0
    with torch.no_grad():
        for _, model_p, main_p in _param_pairs(optimizer):
            main_p.copy_(main_p.to(model_p.dtype).float())
    with pytest.raises(AssertionError, match="the masters are not fp32"):
        check_half_adapters(adapters, optimizer)


FP16_LORA = LoraConfig(r=4, lora_alpha=8, seed=11, dtype="fp16",
                       target_modules=["linear_proj", "linear_fc2"])


@pytest.mark.parametrize("layout", [ParallelLayout()], ids=["TP1"])
@multirank(world_size=1, timeout=300)
def test_fp16_adapters_use_a_loss_scale(layout, tmp_path):
    """fp16 adapters: fp16 parameters and gradients, fp32 masters, megatron's dynamic loss scale
    multiplies the loss (so small gradients survive fp16) and is divided out before the step.
    The scale reached (and its trackers) is checkpointed and restored by a resume."""
    from megatron_lora.training.checkpoint import load_checkpoint, save_checkpoint
    from megatron_lora.training.optimizer import (
        loss_scale_state,
        set_loss_scale_state,
        wrap_for_training,
    )

    model = S.model(layout)
    adapters = apply_lora(model, FP16_LORA, verbose=False)
    losses, optimizer, _ = _steps(model, 2, S.optim(2))
    assert check_half_adapters(adapters, optimizer, torch.float16) > 0
    assert float(optimizer.get_loss_scale()) == 2.0 ** 16
    assert model.config.grad_scale_func is not None
    assert torch.isfinite(losses).all()

    # As after overflows and clean steps: a state no fresh optimizer starts from.
    reached = {"scale": 2.0 ** 9, "growth_tracker": 3, "hysteresis_tracker": 0}
    set_loss_scale_state(optimizer, reached)
    assert loss_scale_state(optimizer) == reached
    save_checkpoint(str(tmp_path), 2, optimizer.wrapped_chunks, optimizer, optimizer.scheduler,
                    {"layout": layout.describe(), "world_size": 1})
    fresh = S.model(layout)
    apply_lora(fresh, FP16_LORA, verbose=False)
    chunks, resumed, scheduler = wrap_for_training([fresh], S.optim(2))
    assert float(resumed.get_loss_scale()) == 2.0 ** 16
    load_checkpoint(str(tmp_path), chunks, resumed, scheduler, layout.describe())
    assert loss_scale_state(resumed) == reached
    assert float(resumed.get_loss_scale()) == 2.0 ** 9


def _safetensors_dtypes(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


@multirank(world_size=1, timeout=400)
def _train_hf(hf, root, layout=ParallelLayout()):
    """A tiny HF Mixtral with bf16 adapters (dropout 0.1): 4 steps saved at 2 and 4 ("full"), then
    a run resumed from the copy of iteration 2 ("resumed") to 4: the same losses and adapters bit
    for bit."""
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf
    from megatron_lora.models.build import build_model, model_config
    from megatron_lora.training.loop import RunConfig, train
    from megatron_lora.training.optimizer import OptimConfig
    from tests.export import _support as E

    info, ckpt, _ = open_hf(hf)
    lora = dataclasses.replace(LORA, lora_dropout=0.1)
    results = {}
    for name in ("full", "resumed"):
        save = os.path.join(root, name)
        if name == "resumed":
            shutil.copytree(os.path.join(root, "full", "iter_0000002"),
                            os.path.join(save, "iter_0000002"))
            with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("2")
        model = build_model(info, model_config(info, layout))
        load_hf(model, info, ckpt)
        adapters = apply_lora(model, lora, verbose=False)
        run = RunConfig(micro_batch_size=1, global_batch_size=2, seq_length=16, train_iters=4,
                        save=save, save_interval=2, log_interval=100)
        result = train([model], E.dataset(), run, OptimConfig(lr=2e-2, train_iters=4),
                       layout_name=layout.describe(), run_metadata={"lora": lora.to_dict()})
        tensors = {k: v.float() for k, v in S.global_adapters(adapters).items()}
        assert all(v.dtype == torch.bfloat16 for v in S.global_adapters(adapters).values())
        tensors["losses"] = torch.tensor([result.losses[i] for i in (3, 4)])
        results[name] = tensors
    for key, value in results["full"].items():
        assert torch.equal(value, results["resumed"][key]), key  # bit for bit
    save_file(results["full"], os.path.join(root, "final.safetensors"))


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    from tests.convert.tiny import make_tiny_mixtral

    root = str(tmp_path_factory.mktemp("bf16_runs"))
    make_tiny_mixtral(os.path.join(root, "hf"), seed=5)
    _train_hf(hf=os.path.join(root, "hf"), root=root)
    return root


def test_bf16_checkpoint_and_peft_export_hold_bf16(hf_runs, tmp_path):
    """The checkpoint's adapter tensors are bf16 (its masters and moments fp32), the run's
    metadata says bf16, a resume from it was exact (_train_hf), and `export peft` writes BF16
    tensors equal to the trained adapters."""
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.export.adapter_ckpt import AdapterCheckpoint
    from megatron_lora.export.to_peft import export_peft

    hf = os.path.join(hf_runs, "hf")
    info, _, _ = open_hf(hf)
    ckpt = AdapterCheckpoint(os.path.join(hf_runs, "full"), info)
    assert ckpt.dtype == torch.bfloat16 and ckpt.config.dtype == torch.bfloat16
    out = str(tmp_path / "peft")
    export_peft(os.path.join(hf_runs, "full"), out, hf_config=hf)
    weights = os.path.join(out, "adapter_model.safetensors")
    assert _safetensors_dtypes(weights) == {"BF16"}
    exported = load_file(weights)
    final = load_file(os.path.join(hf_runs, "final.safetensors"))
    # q_proj's A is linear_qkv's A, copied bit for bit
    a = next(v for k, v in exported.items() if "layers.0.self_attn.q_proj.lora_A" in k)
    assert torch.equal(a.float(), final["decoder.layers.0.self_attention.linear_qkv.A"])


def test_resume_and_adapter_refuse_another_lora_dtype():
    """--lora-dtype is a setting an adapter brings (like --lora-use-dora): a resume whose
    checkpoint has another dtype, or a given --lora-dtype that differs from --adapter's, is
    refused naming the flag; without the flag the adapter's dtype is the run's."""
    from argparse import Namespace

    from megatron_lora.training.initial_adapter import flag_conflicts, set_lora_flags
    from megatron_lora.training.resume import ResumeMismatchError, check_metadata

    bf16, fp32 = LoraConfig(dtype="bf16"), LoraConfig(dtype="fp32")
    with pytest.raises(ResumeMismatchError, match=r"'dtype': 'bfloat16' in the checkpoint, "
                                                  r"'float32' in this run \(--lora-dtype\)"):
        check_metadata("runs/x", {"lora": bf16.to_dict()}, {"lora": fp32.to_dict()})
    assert check_metadata("runs/x", {"lora": bf16.to_dict()}, {"lora": bf16.to_dict()}) == []
    # a checkpoint written before --lora-dtype existed records none (or None): it resumes
    older = {k: v for k, v in fp32.to_dict().items() if k != "dtype"}
    for saved in (older, dict(older, dtype=None)):
        (notice,) = check_metadata("runs/x", {"lora": saved}, {"lora": bf16.to_dict()})
        assert "accepted on resume" in notice and "--lora-dtype" in notice, notice
    args = Namespace(lora_dtype="fp32")
    assert flag_conflicts(args, bf16, {"lora_dtype"}) == ["--lora-dtype fp32 (the adapter's: bf16)"]
    assert flag_conflicts(Namespace(lora_dtype="bf16"), bf16, {"lora_dtype"}) == []
    assert flag_conflicts(args, LoraConfig(), {"lora_dtype"}) == []  # records none: the run's
    assert flag_conflicts(args, bf16, set()) == []  # not given: the adapter's
    set_lora_flags(args, bf16)
    assert args.lora_dtype == "bf16"


@pytest.mark.parametrize("bad", ["2**16", {"scale": 1.0}, {"scale": "1", "growth_tracker": 0,
                                                             "hysteresis_tracker": 1}])
def test_a_malformed_loss_scale_names_the_file_and_field(bad, tmp_path):
    from megatron_lora.runtime.safe_load import CheckpointFileError
    from megatron_lora.training.checkpoint import _common_state

    with pytest.raises(CheckpointFileError) as info:
        _common_state(str(tmp_path), {"common": {}, "scheduler": {}, "loss_scale": bad})
    assert "common.pt" in str(info.value) and "'loss_scale'" in str(info.value)
