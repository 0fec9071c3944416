"""What a resume accepts and how it continues the LR schedule (training/resume.py).

Extending a finished run (--train-iters 4 -> 6) decays over the new horizon from step 4 (a
positive LR, reported iterations 5-6); --use-checkpoint-opt_param-scheduler keeps the
checkpoint's schedule (min LR, or refused naming the flags when that is 0);
--override-opt_param-scheduler takes the command line's; other scheduler changes without a flag
are refused naming the flags; a changed --seed is accepted and a changed rank names only that
field.
"""

import contextlib
import math

import pytest
import torch

from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing.reference import save_weights
from megatron_lora.training.logging import TrainingLog
from megatron_lora.training.loop import ResumeMismatchError, TrainResult, train
from megatron_lora.training.optimizer import OptimConfig
from tests.harness import multirank
from tests.training import _support as S

LR = 3e-3


@contextlib.contextmanager
def _recorded():
    """{k: learning rate of iteration k} for every iteration after the first this run trains (the
    loop logs, after each step, the rate the scheduler set for the next iteration; the first
    one's is in the resume notice), and the loop's messages."""
    lrs, messages = {}, []
    real_iteration, real_message = TrainingLog.iteration, TrainingLog.message

    def iteration(self, it, **kw):
        lrs[it + 1] = kw["lr"]
        return real_iteration(self, it, **kw)

    def message(self, text):
        messages.append(text)
        return real_message(self, text)

    TrainingLog.iteration, TrainingLog.message = iteration, message
    try:
        yield lrs, messages
    finally:
        TrainingLog.iteration, TrainingLog.message = real_iteration, real_message


def _optim(iters, **kw):
    return OptimConfig(**dict(dict(lr=LR, lr_warmup_iters=1, train_iters=iters, clip_grad=1.0),
                              **kw))


def _cosine(step, warmup, horizon, lr=LR, min_lr=0.0):
    ratio = (step - warmup) / (horizon - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * ratio))


def _trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@multirank(world_size=1, timeout=300)
def test_extending_a_finished_run(tmp_path, layout=ParallelLayout()):
    weights = str(tmp_path / "weights")
    first = S.model(layout)
    save_weights(first, weights)
    save = str(tmp_path / "run")
    kw = dict(layout_name=layout.describe(), run_metadata={"lora": {"r": 4}})
    done = train([first], S.dataset(), S.run_config(save, iters=4), _optim(4, min_lr=0.0), **kw)

    # Default: the checkpoint's schedule, decayed over the new --train-iters 6 from step 4.
    model = S.model(layout, weights)
    after = {}
    with _recorded() as (lrs, messages):
        result = train([model], S.dataset(), S.run_config(save, iters=6), _optim(6),
                       on_iteration=lambda it: after.setdefault(it, _trainable(model)), **kw)
    assert sorted(result.losses) == [5, 6]
    # megatron's scheduler and _cosine evaluate the same cosine in Python floats (fp64): a few
    # roundings of 2**-53 apart, far inside rel 1e-12 (a step off moves it by percents)
    assert lrs[6] == pytest.approx(_cosine(5, 1, 6), rel=1e-12) and lrs[6] > 0.05 * LR
    assert isinstance(result, TrainResult) and result.start_iteration == 4
    assert result.describe() == "trained 2 iterations (5-6)"
    assert done.describe() == "trained 4 iterations (1-4)"
    notice = " ".join(messages)
    assert f"{_cosine(4, 1, 6):.4g} at iteration 5" in notice and _cosine(4, 1, 6) > 0.3 * LR
    assert "--train-iters 6" in notice and "--use-checkpoint-opt_param-scheduler" in notice
    # The adapters moved in iteration 6 (not a zero-LR no-op).
    assert max((after[6][n] - after[5][n]).abs().max().item() for n in after[5]) > 0
    # Nothing left to train: reported as such.
    idle = train([S.model(layout, weights)], S.dataset(), S.run_config(save, iters=6), _optim(6),
                 **kw)
    assert idle.describe() == "trained 0 iterations (the checkpoint is at iteration 6)"

    # The checkpoint's schedule kept: its decay ended at step 6 with min LR 0 -> refused.
    with pytest.raises(ResumeMismatchError) as err:
        train([S.model(layout, weights)], S.dataset(), S.run_config(save, iters=8),
              _optim(8, use_checkpoint_opt_param_scheduler=True), **kw)
    text = str(err.value)
    assert "iterations 7-8 would train at learning rate 0" in text
    assert "--use-checkpoint-opt_param-scheduler" in text and "--override-opt_param-scheduler" in text

    # Every setting from the command line: another peak LR and horizon, from step 6.
    with _recorded() as (lrs, messages):
        result = train([S.model(layout, weights)], S.dataset(), S.run_config(save, iters=8),
                       _optim(8, lr=2 * LR, override_opt_param_scheduler=True), **kw)
    assert result.describe() == "trained 2 iterations (7-8)"
    assert lrs[8] == pytest.approx(_cosine(7, 1, 8, lr=2 * LR), rel=1e-12)  # fp64, as above
    assert any("--lr 0.006 (checkpoint: 0.003)" in m for m in messages), messages


@multirank(world_size=1, timeout=300)
def test_checkpoint_schedule_and_refused_changes(tmp_path, layout=ParallelLayout()):
    save = str(tmp_path / "run")
    kw = dict(layout_name=layout.describe(), run_metadata={"lora": {"r": 4}})
    train([S.model(layout)], S.dataset(), S.run_config(save, iters=3),
          _optim(3, min_lr=LR / 10), **kw)

    # Another --lr without a flag: refused, naming the flag and both scheduler flags.
    with pytest.raises(ResumeMismatchError) as err:
        train([S.model(layout)], S.dataset(), S.run_config(save, iters=4),
              _optim(4, lr=2 * LR, min_lr=LR / 10), **kw)
    text = str(err.value)
    assert "--lr 0.006 (checkpoint: 0.003)" in text and "--override-opt_param-scheduler" in text
    assert "--use-checkpoint-opt_param-scheduler" in text and "--train-iters" not in text

    # The checkpoint's schedule kept: past its horizon the LR is its min LR (not 0), whatever
    # --lr this command line has.
    with _recorded() as (lrs, messages):
        result = train([S.model(layout)], S.dataset(), S.run_config(save, iters=5),
                       _optim(5, lr=5 * LR, use_checkpoint_opt_param_scheduler=True), **kw)
    assert result.describe() == "trained 2 iterations (4-5)"
    # past the horizon the scheduler returns its min LR (fp64 arithmetic, as above)
    assert lrs == {5: pytest.approx(LR / 10, rel=1e-12), 6: pytest.approx(LR / 10, rel=1e-12)}
    assert any(f"{LR / 10:.4g} at iteration 4, {LR / 10:.4g} at iteration 5" in m
               for m in messages), messages


@multirank(world_size=1, timeout=300)
def test_a_changed_seed_resumes_and_a_changed_rank_names_only_the_rank(
        tmp_path, layout=ParallelLayout()):
    save = str(tmp_path / "run")
    train([S.model(layout)], S.dataset(), S.run_config(save, iters=2), _optim(3),
          layout_name=layout.describe(), run_metadata={"lora": {"r": 4, "seed": 7}})
    # --seed 7 not repeated: accepted, with a notice naming --seed.
    with _recorded() as (_, messages):
        result = train([S.model(layout)], S.dataset(), S.run_config(save, iters=3), _optim(3),
                       layout_name=layout.describe(),
                       run_metadata={"lora": {"r": 4, "seed": 1234}})
    assert sorted(result.losses) == [3]
    assert any("'seed': 7 in the checkpoint, 1234 in this run (--seed)" in m for m in messages)

    # Another rank: only that field is named, with its flag (not two whole dicts).
    with pytest.raises(ResumeMismatchError) as err:
        train([S.model(layout)], S.dataset(), S.run_config(save, iters=4), _optim(4),
              layout_name=layout.describe(), run_metadata={"lora": {"r": 8, "seed": 1234}})
    text = str(err.value)
    assert "lora 'r': 4 in the checkpoint, 8 in this run (--lora-rank)" in text
    assert "'seed'" not in text and "{" not in text


def test_metadata_differences_name_fields_and_flags():
    from megatron_lora.training.resume import check_metadata

    saved = {"lora": {"r": 4, "lora_alpha": 8.0, "seed": 7, "lora_dropout": 0.0,
                      "target_modules": ["linear_qkv"], "rank_pattern": {}}, "num_layers": 4}
    same_but_accepted = dict(saved, lora=dict(saved["lora"], seed=1234, lora_dropout=0.1))
    notes = check_metadata("run", saved, same_but_accepted)
    assert len(notes) == 2 and "(--seed)" in notes[1] and "(--lora-dropout)" in notes[0]
    other = dict(saved, lora=dict(saved["lora"], target_modules=["linear_qkv", "linear_fc1"],
                                  rank_pattern={"router": 2}), num_layers=8)
    with pytest.raises(ResumeMismatchError) as err:
        check_metadata("run", saved, other)
    text = str(err.value)
    for part in ("'target_modules': ['linear_qkv'] in the checkpoint, ['linear_qkv', "
                 "'linear_fc1'] in this run (--lora-target-modules)",
                 "'rank_pattern': {} in the checkpoint, {'router': 2} in this run "
                 "(--lora-rank-pattern)",
                 "'num_layers': 4 in the checkpoint, 8 in this run (--load/--load-hf)"):
        assert part in text, text
    assert "lora_alpha" not in text and "'seed'" not in text


def test_both_scheduler_flags_are_refused():
    with pytest.raises(ValueError, match="exclude each other"):
        OptimConfig(override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=True)
