"""A resume with LoRA dropout is exact: N iterations straight == N/2, save, resume in a new
(reseeded) task, N/2 more, bit for bit. The masks are keyed by (seed, iteration, global
micro-batch, adapter) (lora/dropout.py), not drawn from the generators, so the resume is exact
even when the checkpoint's RNG states are not restored; the RNG restore (tested here too) is for
everything else that draws (megatron's own dropout). With keys drawn from the default generator,
the resume without the RNG restore repeats iteration 1's masks and leaves the straight run.

Every run starts by re-seeding every generator from the run's seed, as a fresh `megatron-lora train`
process does (runtime.initialize), and the resumes run as harness tasks of their own."""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_lora.lora import global_factors
from megatron_lora.lora.model import LoraConfig, apply_lora
from megatron_lora.runtime import ParallelLayout
from megatron_lora.runtime.rng import seed_everything
from megatron_lora.testing.reference import save_weights
from megatron_lora.training import checkpoint as ckpt
from megatron_lora.training.loop import train
from tests.harness import multirank
from tests.training import _support as S

ITERS = 4
SEED = 1234
LORA = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, seed=11,
                  target_modules=["linear_qkv", "linear_proj", "linear_fc2"])


def _run(directory, save=None, stop_after=None, layout=ParallelLayout()):
    """Train (resuming from `save` if it holds a checkpoint); returns (losses, global adapters)."""
    seed_everything(SEED)  # what a new process does before it builds the model
    model = S.model(layout, os.path.join(directory, "weights"))
    adapters = apply_lora(model, LORA, verbose=False)
    run = S.run_config(save, iters=ITERS, save_interval=ITERS // 2 if save else None)
    result = train([model], S.dataset(), run, S.optim(ITERS), layout_name=layout.describe(),
                   run_metadata={"lora": LORA.to_dict()}, stop_after=stop_after)
    factors = {}
    for name, ad in adapters.items():
        factors[f"{name}.A"], factors[f"{name}.B"] = global_factors(ad)
    return result.losses, factors


def _save(path, losses, factors):
    tensors = dict(factors)
    tensors["iterations"] = torch.tensor(sorted(losses))
    tensors["losses"] = torch.tensor([losses[i] for i in sorted(losses)], dtype=torch.float64)
    save_file(tensors, path)


@multirank(world_size=1, timeout=400)
def _prepare(directory, layout=ParallelLayout()):
    """weights/, straight.safetensors (ITERS iterations in one go) and half/ (a run stopped after
    ITERS/2 with its checkpoint)."""
    save_weights(S.model(layout), os.path.join(directory, "weights"))
    _save(os.path.join(directory, "straight.safetensors"), *_run(directory))
    first, _ = _run(directory, save=os.path.join(directory, "half"), stop_after=ITERS // 2)
    assert sorted(first) == list(range(1, ITERS // 2 + 1))
    assert ckpt.read_tracker(os.path.join(directory, "half")) == ITERS // 2


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("rng_resume"))
    _prepare(directory=directory)
    return directory


@multirank(world_size=1, timeout=400)
def _resume(directory, save, out, restore_rng, layout=ParallelLayout()):
    real = ckpt._set_rng_state
    if not restore_rng:
        ckpt._set_rng_state = lambda state: None  # the bug this guards against
    try:
        losses, factors = _run(directory, save=save)
    finally:
        ckpt._set_rng_state = real
    _save(out, losses, factors)


def _resumed(prepared, tmp_path, restore_rng):
    save = str(tmp_path / "run")
    shutil.copytree(os.path.join(prepared, "half"), save)
    out = str(tmp_path / "resumed.safetensors")
    _resume(directory=prepared, save=save, out=out, restore_rng=restore_rng)
    resumed = load_file(out)
    straight = load_file(os.path.join(prepared, "straight.safetensors"))
    assert resumed["iterations"].tolist() == list(range(ITERS // 2 + 1, ITERS + 1))  # resumed
    return resumed, straight


def test_a_resume_with_dropout_is_bit_identical(prepared, tmp_path):
    resumed, straight = _resumed(prepared, tmp_path, restore_rng=True)
    assert torch.equal(resumed["losses"], straight["losses"][ITERS // 2:])
    names = [k for k in straight if k not in ("iterations", "losses")]
    assert names and sorted(names) == sorted(k for k in resumed if k not in ("iterations", "losses"))
    for name in names:
        assert torch.equal(resumed[name], straight[name]), name


def test_a_resume_without_the_rng_restore_is_still_bit_identical(prepared, tmp_path):
    """Restoring no RNG re-seeds the run as at iteration 1: LoRA's masks must not follow."""
    resumed, straight = _resumed(prepared, tmp_path, restore_rng=False)
    assert torch.equal(resumed["losses"], straight["losses"][ITERS // 2:])
    for name in (k for k in straight if k not in ("iterations", "losses")):
        assert torch.equal(resumed[name], straight[name]), name
