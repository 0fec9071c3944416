"""The training loop gives the same losses at every layout, resumes exactly, and never loads a
half-written checkpoint."""

import json
import os

import pytest
import torch
import torch.distributed as dist

from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing import compare
from megatron_lora.testing.reference import save_weights
from megatron_lora.training import checkpoint as ckpt
from megatron_lora.training.loop import ResumeMismatchError, train
from tests.harness import multirank
from tests.training import _support as S


@multirank(world_size=1, timeout=300)
def _reference_run(directory, layout=ParallelLayout()):
    m = S.model(layout)
    save_weights(m, os.path.join(directory, "weights"))
    result = train([m], S.dataset(), S.run_config(), S.optim(), layout_name=layout.describe())
    # The same run in fp64 from the same start: the reference's own rounding of its losses.
    m64 = S.model(layout, os.path.join(directory, "weights")).double()
    result64 = train([m64], S.dataset(), S.run_config(), S.optim(), layout_name=layout.describe())
    with open(os.path.join(directory, "losses.json"), "w") as f:
        json.dump({"fp32": result.losses, "fp64": result64.losses}, f)


# Every step's loss is a mean over at most 4 x SEQ token cross-entropies of a forward through the
# weights the previous steps trained.
TOKENS = S.run_config().global_batch_size * S.SEQ


def _loss_bound(losses32, losses64):
    """compare.mean_loss_bound over the run's steps {step: loss}: the reference's fp64 run gives
    its own rounding (forward and Adam steps in another order), plus the mean's fp32 reduction."""
    steps = sorted(losses32)
    return compare.mean_loss_bound(torch.tensor([losses32[i] for i in steps]),
                                   torch.tensor([losses64[i] for i in steps]), TOKENS)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("train_reference"))
    _reference_run(directory=directory)
    losses = json.load(open(os.path.join(directory, "losses.json")))
    return directory, {d: {int(k): v for k, v in losses[d].items()} for d in ("fp32", "fp64")}


CASES = [
    pytest.param(ParallelLayout(tp=2, sp=True), 2, id="TP2+SP"),
    pytest.param(ParallelLayout(ep=2), 2, id="EP2"),
    pytest.param(ParallelLayout(pp=2, ep=2), 4, id="PP2xEP2"),
    pytest.param(ParallelLayout(tp=2, pp=2, ep=2, sp=True), 8, id="TP2xPP2xEP2+SP"),
]


@pytest.mark.parametrize("layout,world_size", CASES)
@multirank(world_size=lambda world_size, **_: world_size, timeout=300)
def test_losses_match_the_single_rank_run_at_every_step(layout, world_size, reference):
    directory, losses = reference
    expected = losses["fp32"]
    m = S.model(layout, os.path.join(directory, "weights"))
    result = train([m], S.dataset(), S.run_config(), S.optim(), layout_name=layout.describe())
    assert expected[1] > expected[5] + 0.05  # the run really trains
    steps = sorted(expected)
    compare.assert_within(torch.tensor([result.losses[i] for i in steps]),
                          torch.tensor([expected[i] for i in steps]),
                          _loss_bound(expected, losses["fp64"]),
                          f"losses of steps {steps} at {layout.describe()}")


@multirank(world_size=2, timeout=300)
def test_resume_is_bit_identical_and_reshards(tmp_path, reference, layout=ParallelLayout(ep=2)):
    directory, _ = reference
    weights = os.path.join(directory, "weights")
    straight = train([S.model(layout, weights)], S.dataset(), S.run_config(iters=6), S.optim(6),
                     layout_name=layout.describe()).losses
    save = str(tmp_path / "run")
    first = train([S.model(layout, weights)], S.dataset(), S.run_config(save, iters=6,
                  save_interval=3), S.optim(6), layout_name=layout.describe(), stop_after=3)
    assert first.iteration == 3 and ckpt.read_tracker(save) == 3
    resumed = train([S.model(layout, weights)], S.dataset(), S.run_config(save, iters=6),
                    S.optim(6), layout_name=layout.describe())
    assert [resumed.losses[i] for i in (4, 5, 6)] == [straight[i] for i in (4, 5, 6)]
    # The straight run in fp64: its own rounding bounds the run resumed at another layout below.
    straight64 = train([S.model(layout, weights).double()], S.dataset(), S.run_config(iters=6),
                       S.optim(6), layout_name=layout.describe()).losses

    # The same checkpoint resumed at another layout (TP2+SP) continues within the bound of
    # another evaluation order (_loss_bound).
    from megatron_lora import runtime

    other = ParallelLayout(tp=2, sp=True)
    runtime.initialize(other)
    copy = str(tmp_path / "run_other")
    if dist.get_rank() == 0:
        import shutil

        shutil.copytree(save, copy)
        shutil.rmtree(os.path.join(copy, "iter_0000006"))
        ckpt._write_tracker(copy, 3)
    dist.barrier()
    moved = train([S.model(other, weights)], S.dataset(), S.run_config(copy, iters=6), S.optim(6),
                  layout_name=other.describe())
    later = (4, 5, 6)
    compare.assert_within(torch.tensor([moved.losses[i] for i in later]),
                          torch.tensor([straight[i] for i in later]),
                          _loss_bound({i: straight[i] for i in later},
                                      {i: straight64[i] for i in later}),
                          "losses of steps 4-6 resumed at TP2+SP")


@multirank(world_size=2, timeout=300)
def test_a_crash_during_save_keeps_the_previous_checkpoint(tmp_path, reference,
                                                          layout=ParallelLayout(ep=2)):
    directory, _ = reference
    weights = os.path.join(directory, "weights")
    save = str(tmp_path / "run")
    train([S.model(layout, weights)], S.dataset(), S.run_config(save, iters=2, save_interval=2),
          S.optim(4), layout_name=layout.describe())
    real_save = ckpt.dist_checkpointing.save

    def killed_after_writing(state, directory, *args, **kwargs):
        real_save(state, directory, *args, **kwargs)  # the shards are on disk ...
        raise KeyboardInterrupt("job killed before the checkpoint was renamed into place")

    ckpt.dist_checkpointing.save = killed_after_writing
    try:
        with pytest.raises(KeyboardInterrupt):
            train([S.model(layout, weights)], S.dataset(), S.run_config(save, iters=4,
                  save_interval=2), S.optim(4), layout_name=layout.describe())
    finally:
        ckpt.dist_checkpointing.save = real_save
    dist.barrier()
    assert ckpt.read_tracker(save) == 2
    assert os.path.isdir(os.path.join(save, "iter_0000004.tmp"))  # the half-written one
    assert not os.path.exists(os.path.join(save, "iter_0000004"))
    resumed = train([S.model(layout, weights)], S.dataset(), S.run_config(save, iters=3),
                    S.optim(4), layout_name=layout.describe(), stop_after=3)
    assert resumed.iteration == 3 and list(resumed.losses) == [3]


@multirank(world_size=1, timeout=300)
def test_resume_with_other_run_metadata_is_refused_before_training(tmp_path, reference,
                                                                   layout=ParallelLayout()):
    directory, _ = reference
    save = str(tmp_path / "run")
    train([S.model(layout)], S.dataset(), S.run_config(save, iters=1), S.optim(2),
          layout_name=layout.describe(), run_metadata={"lora_rank": 8})
    with pytest.raises(ResumeMismatchError, match="lora_rank"):
        train([S.model(layout)], S.dataset(), S.run_config(save, iters=2), S.optim(2),
              layout_name=layout.describe(), run_metadata={"lora_rank": 16})


@multirank(world_size=2, timeout=120)
def test_batch_sizes_that_do_not_divide_are_refused_on_every_rank(layout=ParallelLayout(ep=2)):
    from megatron_lora.training.loop import RunConfig

    bad = RunConfig(micro_batch_size=2, global_batch_size=6, seq_length=S.SEQ, train_iters=1)
    with pytest.raises(ValueError, match="not divisible by micro_batch_size\\*data_parallel_size"):
        train([S.model(layout)], S.dataset(), bad, S.optim(1), layout_name=layout.describe())


@multirank(world_size=1, timeout=300)
def test_a_non_finite_loss_stops_training_at_its_iteration(tmp_path, reference,
                                                            layout=ParallelLayout()):
    """A loss that is NaN while the gradients are finite (a loss function gone wrong) is found
    where the losses are read (the log line of iteration 4) and named by its iteration, 3;
    nothing after iteration 2's checkpoint is saved."""
    import dataclasses

    from megatron_lora.training import loop
    from megatron_lora.training.loop import TrainingDiverged

    weights = os.path.join(reference[0], "weights")

    real = loop.forward_backward

    def nan_at_3(*args, iteration, **kwargs):
        loss = real(*args, iteration=iteration, **kwargs)
        return loss * float("nan") if iteration == 3 else loss

    loop.forward_backward = nan_at_3
    save = str(tmp_path / "run")
    try:
        with pytest.raises(TrainingDiverged, match="iteration 3: the loss is nan") as caught:
            run = dataclasses.replace(S.run_config(save, iters=6, save_interval=2),
                                      log_interval=4)
            train([S.model(layout, weights)], S.dataset(), run, S.optim(6),
                  layout_name=layout.describe())
    finally:
        loop.forward_backward = real
    assert "iter_0000002" in str(caught.value)
    assert sorted(d for d in os.listdir(save) if d.startswith("iter_")) == ["iter_0000002"]
