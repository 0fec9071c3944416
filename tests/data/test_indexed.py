"""data/indexed.py (and data/sources.py): a preprocessed prefix gives the batches of its JSONL
file, row for row, at every consumed-samples position; Megatron-LM prefixes without loss masks
train on every token; mismatched inputs are refused; training losses are identical (TP2+SP, PP2xEP2)."""

import json
import os

import numpy as np
import pytest
import torch

from megatron_lora.data import DataError, load_tokenizer
from megatron_lora.data.indexed import IndexedSamples, plan_packing
from megatron_lora.data.preprocess import preprocess
from megatron_lora.data.sources import open_data
from megatron_lora.runtime import ParallelLayout
from tests.data.tiny_tokenizers import chatml_folder
from tests.harness import multirank

FIELDS = ("tokens", "labels", "loss_mask", "attention_mask")


def _lines(n):
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append({"text": f"sample {i}: " + "word " * (i % 9)})
        elif kind == 1:
            out.append({"prompt": f"Q{i}: " + "ctx " * (i % 6), "response": f" answer {i}"})
        elif kind == 2:
            out.append({"messages": [{"role": "user", "content": f"hi {i}"},
                                     {"role": "assistant", "content": "ok " * (i % 5 + 1)}]})
        else:  # all context once truncated at short lengths: dropped there, as in read_jsonl
            out.append({"prompt": "p" * 40, "response": " r"})
    return out


def _data(folder, spec, n=64):
    path = os.path.join(folder, "d.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in _lines(n))
    prefix = os.path.join(folder, "d")
    preprocess([path], spec, prefix, progress_interval=-1)
    return path, prefix


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return chatml_folder(tmp_path_factory.mktemp("chatml"))


def _assert_same(a, b, positions, gbs=5):
    for pos in positions:
        x, y = a.batch(pos, gbs), b.batch(pos, gbs)
        for k in FIELDS:
            assert torch.equal(getattr(x, k), getattr(y, k)), (pos, k)


@pytest.mark.parametrize("spec", ["byte", "chatml"])
@pytest.mark.parametrize("seq_length", [24, 64])
def test_prefix_batches_are_the_jsonl_batches(tmp_path, spec, seq_length, chatml):
    spec = chatml if spec == "chatml" else spec
    tok = load_tokenizer(spec)
    path, prefix = _data(str(tmp_path), spec)
    for fraction in (0.0, 0.25):
        a = open_data([path], tok, seq_length, seed=7, eval_fraction=fraction)
        b = open_data([prefix], tok, seq_length, seed=7, eval_fraction=fraction)
        assert (a.samples, a.truncated) == (b.samples, b.truncated)
        assert len(a.train) == len(b.train) > 4
        # Into the second and third epochs (re-shuffled): the whole order, not just the first.
        _assert_same(a.train, b.train, [0, 3, len(a.train) - 2, 2 * len(a.train) + 1])
        if fraction:
            assert len(a.held_out) == len(b.held_out) > 0
            _assert_same(a.held_out, b.held_out, [0, 1])
    if seq_length == 24:
        assert a.truncated > 0 and a.samples < 64  # truncation and dropped samples exercised
    other = open_data([prefix], tok, seq_length, seed=8)
    assert not torch.equal(other.train.batch(0, 5).tokens, b.train.batch(0, 5).tokens)


def test_split_takes_each_part_in_order_and_the_same_rows_from_jsonl_and_prefix(tmp_path):
    from megatron_lora.data.sources import parse_split, split_rows

    assert parse_split("98,2,0") == pytest.approx((0.98, 0.02, 0.0))
    assert parse_split("3,1") == (0.75, 0.25, 0.0)
    for bad in ("0,1,0", "a,b", "1,2,3,4", "1,-1", "nan,1"):
        with pytest.raises(ValueError, match="--split .*expected up to three"):
            parse_split(bad)
    assert split_rows(100, split=parse_split("90,8,2")) == ((0, 90), (90, 98))
    assert split_rows(100, eval_fraction=0.1) == ((0, 90), (90, 100))
    tok = load_tokenizer("byte")
    path, prefix = _data(str(tmp_path), "byte")
    split = parse_split("6,2,2")
    a = open_data([path], tok, 24, seed=7, split=split)
    b = open_data([prefix], tok, 24, seed=7, split=split)
    whole = open_data([prefix], tok, 24, seed=7)
    n = len(whole.train)
    assert len(a.train) == len(b.train) == round(0.6 * n) and len(b.held_out) == round(0.8 * n) - \
        round(0.6 * n)
    _assert_same(a.train, b.train, [0, 7])
    _assert_same(a.held_out, b.held_out, [0, 1])
    # The validation rows are rows 0.6n..0.8n of the whole plan: none of them trains.
    held_rows = b.held_out.rows(range(len(b.held_out)))[0]
    train_rows = b.train.rows(range(len(b.train)))[0]
    assert torch.equal(held_rows, whole.train.rows(range(len(b.train), round(0.8 * n)))[0])
    assert not any(torch.equal(h, t) for h in held_rows for t in train_rows)


def test_loss_masks_are_scanned_the_same_in_small_chunks(tmp_path, monkeypatch):
    import megatron_lora.data.indexed as indexed

    _, prefix = _data(str(tmp_path), "byte")
    samples = IndexedSamples(prefix)
    whole = samples.first_targets()
    expected = [next((j for j in range(1, len(t)) if t[j]), len(t))
                for t in (samples.targets(i).tolist() for i in range(len(samples)))]
    assert whole.tolist() == expected and len(set(expected)) > 3
    for chunk in (1, 7, 100):  # chunks of one sample, and chunks cutting samples in two
        monkeypatch.setattr(indexed, "_CHUNK_TOKENS", chunk)
        assert samples.first_targets().tolist() == expected


def test_a_megatron_lm_prefix_trains_on_every_token(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "mlm")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    docs = [[256, 5, 6, 7, 257], [256, 9, 257], [3]]
    for doc in docs:
        builder.add_document(np.array(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    samples = IndexedSamples(prefix)
    assert samples.targets_ds is None and samples.targets(0).tolist() == [1] * 5
    plan = plan_packing(samples, 9)
    assert plan.kept.tolist() == [0, 1] and plan.row_starts.tolist() == [0, 2]  # [3] dropped
    data = open_data([prefix], load_tokenizer("byte"), 5, seed=1)  # rows of 6: one sample each
    batch = data.train.batch(0, 2)
    assert sorted(batch.tokens.tolist()) == [[256, 5, 6, 7, 257], [256, 9, 257, 258, 258]]
    assert batch.loss_mask.sum() == 4 + 2


def test_a_prefix_with_token_ids_outside_the_vocabulary_is_refused(tmp_path, monkeypatch):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    monkeypatch.setattr("megatron_lora.data.indexed._CHUNK_TOKENS", 2)  # several chunks
    prefix = str(tmp_path / "mlm")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in ([256, 5, 6, 7, 257], [256, 9, 300, 257], [3, 4]):  # byte has 259 ids
        builder.add_document(np.array(doc), [len(doc)])
    builder.finalize(prefix + ".idx")
    assert IndexedSamples(prefix).max_token() == 300
    with pytest.raises(DataError, match=r"^--data-path .*mlm: .*mlm.bin holds token id 300, "
                       r"outside the --tokenizer's 259 ids"):
        open_data([prefix], load_tokenizer("byte"), 5, seed=1)


def test_mismatched_or_incomplete_prefixes_are_refused(tmp_path, chatml):
    path, prefix = _data(str(tmp_path), "byte", n=8)
    with pytest.raises(DataError, match="written with the tokenizer 'byte'.*vocab_size 259 there"):
        open_data([prefix], load_tokenizer(chatml), 32, seed=1)
    os.rename(prefix + "_targets.idx", prefix + "_targets.idx.moved")
    with pytest.raises(DataError, match="the loss masks written by `megatron-lora preprocess`"):
        open_data([prefix], load_tokenizer("byte"), 32, seed=1)
    with pytest.raises(DataError, match="--data-path .*nothing: neither a JSONL file nor"):
        open_data([str(tmp_path / "nothing")], load_tokenizer("byte"), 32, seed=1)


@pytest.fixture(scope="module")
def loss_data(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("indexed_losses"))
    _data(folder, "byte", n=48)
    return folder


@pytest.mark.parametrize("layout,world_size", [
    pytest.param(ParallelLayout(tp=2, sp=True), 2, id="TP2+SP"),
    pytest.param(ParallelLayout(pp=2, ep=2), 4, id="PP2xEP2"),
])
@multirank(world_size=lambda world_size, **_: world_size, timeout=300)
def test_training_losses_from_a_prefix_equal_those_from_its_jsonl(loss_data, layout, world_size):
    """The same LoRA run (fp32, dropout 0.1) from the JSONL file and from its prefix: identical
    losses at TP2+SP and at PP2xEP2 (each rank holds its own stage's and experts' adapters), and
    it trains."""
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.runtime.rng import seed_everything
    from megatron_lora.training.loop import train
    from tests.training import _support as S

    tok = load_tokenizer("byte")
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, seed=11,
                      target_modules=["linear_qkv", "linear_proj", "linear_fc2"])
    losses = {}
    for name in ("d.jsonl", "d"):
        seed_everything(29)  # the same base weights and dropout masks in both runs
        model = S.model(layout)
        adapters = apply_lora(model, lora, verbose=False)
        data = open_data([os.path.join(loss_data, name)], tok, S.SEQ, seed=5)
        result = train([model], data.train, S.run_config(iters=3), S.optim(3),
                       layout_name=layout.describe())
        losses[name] = [result.losses[i] for i in range(1, 4)]
        assert all(float(ad.lora_B.abs().max()) > 0 for ad in adapters.values())
    assert losses["d"] == losses["d.jsonl"], losses
    assert losses["d"][-1] < losses["d"][0]
    assert len(set(losses["d"])) == 3
