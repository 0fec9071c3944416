"""A resume is exact with no RNG state: checkpoints carry none, and nothing a run computes after
its model is built depends on a generator.

Every random draw of a training step is keyed instead: LoRA dropout masks by (run seed,
iteration, global micro-batch, adapter) (lora/dropout.py), the data order by (seed, epoch)
(data/batches.py); attention and hidden dropout are 0 (models/gpt.py). So:

- N iterations straight == N/2, save, resume in a new (reseeded) task, N/2 more, bit for bit,
  with LoRA dropout 0.3;
- a checkpoint has no `rng/` folder, and an older checkpoint's (even one that is not a torch
  file) is never read: the resume from it is the same;
- re-seeding every generator (torch, Python, NumPy, megatron's named streams) with other seeds
  before every iteration changes no loss and no adapter bit, with dropout on every kind of
  adapter (attention, experts, router, output layer), DoRA, grouped experts with activation
  recomputation, and at TP2+SP (where megatron forks its tensor-parallel stream around every
  layer); no generator moves in a training step. Control: with the dropout keys drawn from the
  default generator (the keying off) the same re-seeding changes the losses.

Every run starts by re-seeding every generator from the run's seed, as a fresh `megatron-lora
train` process does (runtime.initialize), and the resumes run as harness tasks of their own."""

import os
import random
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_lora.lora.model import LoraConfig, apply_lora
from megatron_lora.runtime import ParallelLayout
from megatron_lora.runtime.rng import seed_everything, seed_generators
from megatron_lora.testing.reference import load_weights, save_weights
from megatron_lora.training import checkpoint as ckpt
from megatron_lora.training.loop import train
from tests.harness import multirank
from tests.training import _support as S

ITERS = 4
SEED = 1234
LORA = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, seed=11,
                  target_modules=["linear_qkv", "linear_proj", "linear_fc2"])
# Dropout on every adapter kind that has it (the embedding's input is token ids: none), B != 0.
EVERY_KIND = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, seed=11, init_lora_weights=False,
                        target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
                                        "router", "output_layer", "embedding"])
DORA = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.3, seed=11, use_dora=True,
                  target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])


def _model(layout, directory, variant="sequential"):
    """The tiny model with the prepared weights; "grouped": grouped experts (--moe-grouped-gemm)
    and full activation recomputation of every layer."""
    if variant == "sequential":
        return S.model(layout, os.path.join(directory, "weights"))
    from megatron_lora.models.gpt import build_gpt_model, transformer_config
    from megatron_lora.models.recompute import recompute_overrides
    from megatron_lora.models.specs import local_block_spec

    config = transformer_config(S.SHAPE, layout, **recompute_overrides("full", "uniform", 1, None))
    model = build_gpt_model(S.SHAPE, config,
                            block_spec=local_block_spec(config, moe_grouped_gemm=True))
    load_weights(model, os.path.join(directory, "weights"))
    return model


def _run(directory, save=None, stop_after=None, layout=ParallelLayout(), lora=LORA,
         variant="sequential", on_iteration=None, before=None):
    """Train (resuming from `save` if it holds a checkpoint); returns (losses, global adapters).
    before(): called after the model is built, just before training."""
    seed_everything(SEED)  # what a new process does before it builds the model
    model = _model(layout, directory, variant)
    adapters = apply_lora(model, lora, verbose=False)
    run = S.run_config(save, iters=ITERS, save_interval=ITERS // 2 if save else None)
    if before is not None:
        before()
    result = train([model], S.dataset(), run, S.optim(ITERS), layout_name=layout.describe(),
                   run_metadata={"lora": lora.to_dict()}, stop_after=stop_after,
                   on_iteration=on_iteration)
    return result.losses, S.global_adapters(adapters)


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
def _resume(directory, save, out, layout=ParallelLayout()):
    _save(out, *_run(directory, save=save))


def _resumed(prepared, tmp_path, prepare_copy=None):
    save = str(tmp_path / "run")
    shutil.copytree(os.path.join(prepared, "half"), save)
    if prepare_copy is not None:
        prepare_copy(ckpt.iteration_dir(save, ITERS // 2))
    out = str(tmp_path / "resumed.safetensors")
    _resume(directory=prepared, save=save, out=out)
    resumed = load_file(out)
    straight = load_file(os.path.join(prepared, "straight.safetensors"))
    assert resumed["iterations"].tolist() == list(range(ITERS // 2 + 1, ITERS + 1))  # resumed
    return resumed, straight


def _assert_bit_identical(resumed, straight):
    assert torch.equal(resumed["losses"], straight["losses"][ITERS // 2:])
    names = [k for k in straight if k not in ("iterations", "losses")]
    assert names and sorted(names) == sorted(k for k in resumed if k not in ("iterations", "losses"))
    for name in names:
        assert torch.equal(resumed[name], straight[name]), name


def test_a_resume_with_dropout_is_bit_identical(prepared, tmp_path):
    _assert_bit_identical(*_resumed(prepared, tmp_path))


def test_a_checkpoint_holds_no_rng_state(prepared):
    folder = ckpt.iteration_dir(os.path.join(prepared, "half"), ITERS // 2)
    # a complete checkpoint (common.pt, or megatron-core 0.19's in-checkpoint common state)
    assert os.path.isfile(os.path.join(folder, "metadata.json"))
    assert ckpt.read_run_metadata(folder)["iteration"] == ITERS // 2
    assert not os.path.exists(os.path.join(folder, "rng")), os.listdir(folder)


def test_an_older_checkpoints_rng_folder_is_never_read(prepared, tmp_path):
    """Older versions wrote rng/rank_XXXXX.pt; one that is not even a torch file is ignored (not
    refused, not read) and the resume is still the straight run."""
    def add_rng_folder(folder):
        os.makedirs(os.path.join(folder, "rng"), exist_ok=True)
        with open(os.path.join(folder, "rng", "rank_00000.pt"), "wb") as f:
            f.write(b"not a torch archive")

    _assert_bit_identical(*_resumed(prepared, tmp_path, add_rng_folder))


def _generator_states():
    from megatron.core.tensor_parallel import random as mrandom

    from megatron_lora.lora.dropout import MICRO_BATCH_KEY

    tracker = mrandom.get_cuda_rng_tracker().get_states()
    return {"torch": torch.get_rng_state(), "python": torch.tensor(random.getstate()[1]),
            "numpy": torch.from_numpy(np.random.get_state()[1].astype(np.int64)),
            **{f"megatron {name}": torch.as_tensor(state).cpu()
               for name, state in tracker.items() if name != MICRO_BATCH_KEY}}


def _moved(before, after):
    return sorted(k for k in set(before) | set(after)
                  if k not in before or k not in after or not torch.equal(before[k], after[k]))


def _reseeded_run(directory, layout, lora, variant):
    """(losses, adapters) of the run with every generator re-seeded (other seeds each time)
    before iteration 1 and after every iteration; the run seed (dropout keys) unchanged."""
    return _run(directory, layout=layout, lora=lora, variant=variant,
                before=lambda: seed_generators(777),
                on_iteration=lambda it: seed_generators(1000 + it))


def _differences(first, second):
    (l1, f1), (l2, f2) = first, second
    bad = [f"loss {i}: {l1[i]!r} != {l2.get(i)!r}" for i in sorted(l1) if l1[i] != l2.get(i)]
    assert sorted(f1) == sorted(f2) and f1
    return bad + [name for name in sorted(f1) if not torch.equal(f1[name], f2[name])]


@multirank(world_size=lambda layout, **_: layout.tp * layout.pp, timeout=600)
def _independence(directory, cases, layout):
    problems = []
    for name, lora, variant in cases:
        start, moved = {}, set()

        def record():
            start.update(_generator_states())

        def check(it):
            moved.update(f"{m} (iteration {it})" for m in _moved(start, _generator_states()))

        plain = _run(directory, layout=layout, lora=lora, variant=variant, before=record,
                     on_iteration=check)
        assert sorted(plain[0]) == list(range(1, ITERS + 1))
        if moved:
            problems.append(f"{name}: a training step moved {sorted(moved)}")
        bad = _differences(plain, _reseeded_run(directory, layout, lora, variant))
        if bad:
            problems.append(f"{name}: re-seeding the generators changed {bad[:6]}")
    assert not problems, problems


@multirank(world_size=1, timeout=600)
def _control(directory, layout=ParallelLayout()):
    """Dropout keys drawn from the default generator (the keying off, as before it existed):
    re-seeding the generators must change the run, or the independence test shows nothing."""
    from megatron_lora.training import step

    real = step.set_micro_batch_key
    step.set_micro_batch_key = lambda *args: None
    try:
        plain = _run(directory, layout=layout, lora=EVERY_KIND)
        bad = _differences(plain, _reseeded_run(directory, layout, EVERY_KIND, "sequential"))
    finally:
        step.set_micro_batch_key = real
    assert any(b.startswith("loss") for b in bad), bad


@pytest.mark.parametrize("layout,cases", [
    (ParallelLayout(), [("every kind", EVERY_KIND, "sequential"), ("DoRA", DORA, "sequential"),
                        ("grouped + recompute", EVERY_KIND, "grouped")]),
    (ParallelLayout(tp=2, sp=True), [("every kind", EVERY_KIND, "sequential")]),
], ids=["1", "TP2+SP"])
def test_no_training_result_depends_on_a_generator(prepared, layout, cases):
    _independence(directory=prepared, cases=cases, layout=layout)
    if layout.tp == 1:
        _control(directory=prepared)
