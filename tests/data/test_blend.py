"""data/blend.py: weighted blends (Megatron-LM's `--data-path 0.7 A 0.3 B`) draw in proportion,
deterministically, addressed by consumed samples, so a resumed training run continues exactly,
at its own layout bit for bit and at another in the same sample order."""

import json
import os

import numpy as np
import pytest
import torch

from megatron_lora.data import load_tokenizer
from megatron_lora.data.blend import BlendedDataset, blend_schedule, parse_blend
from megatron_lora.data.preprocess import preprocess
from megatron_lora.data.sources import open_data
from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.25, 0.125, 0.125], [0.9, 0.07, 0.03]])
def test_proportions_are_within_the_stated_tolerance_at_every_length(weights):
    """After every n draws, dataset d was drawn w_d * n times within 1 + D/2 (D datasets)."""
    n = 20000
    dataset, draw = blend_schedule(weights, n)
    counts = np.stack([np.cumsum(dataset == d) for d in range(len(weights))], axis=1)
    expected = np.outer(np.arange(1, n + 1), weights)
    assert np.abs(counts - expected).max() <= 1 + len(weights) / 2
    for d in range(len(weights)):  # the k-th draw of d is numbered k
        assert draw[dataset == d].tolist() == list(range(int((dataset == d).sum())))


def test_the_schedule_is_a_pure_function_of_the_position():
    whole, draws = blend_schedule([0.7, 0.3], 5000)
    for n in (1, 7, 1000, 4999):
        part, part_draws = blend_schedule([0.7, 0.3], n)
        assert np.array_equal(part, whole[:n]) and np.array_equal(part_draws, draws[:n])
    assert np.array_equal(blend_schedule([7, 3], 5000)[0], whole)  # weights are normalised


def test_parse_blend_forms_and_errors():
    assert parse_blend(["a"]) == [(1.0, "a")]
    assert parse_blend(["3", "a", "1", "b"]) == [(0.75, "a"), (0.25, "b")]
    with pytest.raises(ValueError, match="--data-path: expected one path, or weight-path pairs"):
        parse_blend(["0.5", "a", "b"])
    with pytest.raises(ValueError, match="'a' is not a weight"):
        parse_blend(["a", "b"])
    with pytest.raises(ValueError, match="the weight of b must be a positive number, got -1"):
        parse_blend(["1", "a", "-1", "b"])


def _prefix(folder, name, n, tag):
    path = os.path.join(folder, name + ".jsonl")
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"{tag}{i}"}) + "\n")
    preprocess([path], "byte", os.path.join(folder, name), progress_interval=-1)
    return os.path.join(folder, name), path


def test_a_blend_of_prefixes_draws_their_rows_in_proportion_and_resumes_exactly(tmp_path):
    tok = load_tokenizer("byte")
    a, a_jsonl = _prefix(str(tmp_path), "a", 30, "A")
    b, _ = _prefix(str(tmp_path), "b", 11, "B")
    # One sample per row: rows of 7 tokens hold one sample of 4-5 tokens ("<s>A12</s>"), not two.
    blend = open_data(["0.7", a, "0.3", b], tok, 6, seed=3).train
    assert isinstance(blend, BlendedDataset) and len(blend) == 41
    gbs, steps = 10, 40
    first = [blend.batch(i * gbs, gbs).tokens for i in range(steps)]
    from_a = sum(int((t[:, 1] == ord("A")).sum()) for t in first)
    from_b = sum(int((t[:, 1] == ord("B")).sum()) for t in first)
    assert from_a + from_b == gbs * steps
    assert abs(from_a - 0.7 * gbs * steps) <= 2  # 1 + D/2
    # A fresh dataset (a resumed run) asked from consumed samples 170 on: the same batches.
    again = open_data(["0.7", a, "0.3", b], tok, 6, seed=3).train
    for i in (17, 39):
        assert torch.equal(again.batch(i * gbs, gbs).tokens, first[i])
    # The A part of the blend is prefix A's own stream in its seed order, JSONL or prefix.
    alone = open_data([a_jsonl], tok, 6, seed=3).train
    mine = [row for t in first[:6] for row in t if row[1] == ord("A")]
    expected = [alone.batch(k, 1).tokens[0] for k in range(len(mine))]
    assert all(torch.equal(x, y) for x, y in zip(mine, expected))
    # A blend of the JSONL file and prefix B: the same batches as of the two prefixes.
    mixed = open_data(["0.7", a_jsonl, "0.3", b], tok, 6, seed=3).train
    for i in (0, 9, 39):
        assert torch.equal(mixed.batch(i * gbs, gbs).tokens, first[i])
    other = open_data(["0.7", a, "0.3", b], tok, 6, seed=4).train
    assert not torch.equal(other.batch(0, gbs).tokens, first[0])


def test_a_blend_holds_out_each_part(tmp_path):
    tok = load_tokenizer("byte")
    a, _ = _prefix(str(tmp_path), "a", 20, "A")
    b, b_jsonl = _prefix(str(tmp_path), "b", 10, "B")
    data = open_data(["1", a, "1", b_jsonl], tok, 6, seed=3, eval_fraction=0.2)
    assert len(data.train) == 16 + 8 and len(data.held_out) == 4 + 2
    from megatron_lora.data import DataError

    with pytest.raises(DataError, match="holds out no sequence of"):
        open_data(["1", a, "1", b], tok, 6, seed=3, eval_fraction=0.04)


_BLEND_LORA = dict(r=4, lora_alpha=8, lora_dropout=0.1, seed=11,
                   target_modules=["linear_qkv", "linear_proj", "linear_fc2"])


def _blend_run(folder, layout, save=None, stop_after=None, iters=4, dtype=torch.float32):
    """A LoRA run (dropout 0.1; the model in `dtype`, fp64: the fp32 weights upcast exactly) on
    the blend 0.7 A 0.3 B of `folder`, from a fresh dataset and freshly seeded generators (as a
    new `train` process): (losses {iteration: loss}, [(consumed samples, batch tokens)] of the
    batches the loop asked for)."""
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.runtime.rng import seed_everything
    from megatron_lora.training.loop import train
    from tests.training import _support as S

    seed_everything(29)
    model = S.model(layout, os.path.join(folder, "weights"))
    lora = LoraConfig(**_BLEND_LORA)
    adapters = apply_lora(model, lora, verbose=False)
    model.to(dtype)
    data = open_data(["0.7", os.path.join(folder, "a"), "0.3", os.path.join(folder, "b")],
                     load_tokenizer("byte"), S.SEQ, seed=5).train
    asked, real_batch = [], data.batch

    def batch(consumed, gbs):
        got = real_batch(consumed, gbs)
        asked.append((consumed, got.tokens.clone()))
        return got

    data.batch = batch
    run = S.run_config(save, iters=iters, save_interval=2 if save else None)
    result = train([model], data, run, S.optim(iters), layout_name=layout.describe(),
                   run_metadata={"lora": lora.to_dict()}, stop_after=stop_after)
    assert all(float(ad.lora_B.abs().max()) > 0 for ad in adapters.values())
    return result.losses, asked


@pytest.fixture(scope="module")
def blend_folder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("blend_resume"))
    _prefix(folder, "a", 120, "A")  # about 20 rows of 33 tokens
    _prefix(folder, "b", 60, "B")  # about 10
    return folder


@multirank(world_size=2, timeout=300)
def test_a_run_on_a_blend_resumes_exactly_and_at_another_layout_in_the_same_order(
        tmp_path, blend_folder, layout=ParallelLayout(ep=2)):
    """4 iterations straight == 2, save, resume from a fresh dataset and reseeded generators, 2
    more: the same batches and bit-identical losses at EP2 (dropout 0.1: the checkpoint's RNG
    state); resumed at TP2+SP from the same checkpoint, the same batches again (the blend is
    addressed by consumed samples) and the same losses to fp32 rounding (the dropout masks are
    keyed by iteration and global micro-batch, lora/dropout.py)."""
    import shutil

    import torch.distributed as dist

    from megatron_lora import runtime
    from megatron_lora.runtime.rng import seed_everything
    from megatron_lora.testing.reference import save_weights
    from megatron_lora.training import checkpoint as ckpt
    from tests.training import _support as S

    folder = str(tmp_path)
    if dist.get_rank() == 0:
        for name in os.listdir(blend_folder):
            shutil.copy(os.path.join(blend_folder, name), folder)
    dist.barrier()
    seed_everything(29)
    save_weights(S.model(layout), os.path.join(folder, "weights"))
    straight, straight_asked = _blend_run(folder, layout)
    assert [c for c, _ in straight_asked] == [0, 4, 8, 12]
    assert straight[4] < straight[1] and len(set(straight.values())) == 4
    save = os.path.join(folder, "run")
    first, _ = _blend_run(folder, layout, save, stop_after=2)
    assert sorted(first) == [1, 2] and ckpt.read_tracker(save) == 2
    if dist.get_rank() == 0:  # a copy of the iteration-2 checkpoint for the other layout
        shutil.copytree(save, save + "_other")
    dist.barrier()
    resumed, asked = _blend_run(folder, layout, save)
    assert sorted(resumed) == [3, 4]
    assert [resumed[i] for i in (3, 4)] == [straight[i] for i in (3, 4)]
    assert [c for c, _ in asked] == [8, 12]
    assert all(torch.equal(t, u) for (_, t), (_, u) in zip(asked, straight_asked[2:]))
    # Both parts drawn, in about 0.7 / 0.3 (rows of ~6 samples, each text "A12" has one letter).
    tokens = torch.cat([t for _, t in straight_asked])
    from_a, from_b = int((tokens == ord("A")).sum()), int((tokens == ord("B")).sum())
    assert 0.6 < from_a / (from_a + from_b) < 0.8, (from_a, from_b)

    other = ParallelLayout(tp=2, sp=True)
    runtime.initialize(other)
    moved, moved_asked = _blend_run(folder, other, save + "_other")
    assert [c for c, _ in moved_asked] == [8, 12]
    assert all(torch.equal(t, u) for (_, t), (_, u) in zip(moved_asked, straight_asked[2:]))
    # Equal to fp32 rounding (the same masks at TP2+SP as at EP2): each loss is a mean over at
    # most global batch x SEQ token cross-entropies, bounded by compare.mean_loss_bound from the
    # straight run's fp64 twin (its rounding over 4 steps covers the 2 resumed ones, which
    # start from the same checkpoint). With masks drawn from the generators they were about
    # 5e-4 apart, and a run that did not take the checkpoint's adapters and optimizer state
    # would be about 2e-2 away.
    from megatron_lora.testing import compare

    runtime.initialize(layout)
    straight64, _ = _blend_run(folder, layout, dtype=torch.float64)
    want = torch.tensor([straight[i] for i in (3, 4)], dtype=torch.float64)
    want64 = torch.tensor([straight64[i] for i in (3, 4)], dtype=torch.float64)
    bound = compare.mean_loss_bound(want, want64, S.run_config().global_batch_size * S.SEQ)
    compare.assert_within(torch.tensor([moved[i] for i in (3, 4)], dtype=torch.float64), want,
                          bound, "losses of steps 3, 4 resumed at TP2+SP vs straight at EP2")
