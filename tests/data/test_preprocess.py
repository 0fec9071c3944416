"""data/preprocess.py: JSONL -> megatron-core indexed datasets that hold exactly the samples the
JSONL path makes, whatever the number of workers, written atomically."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from megatron_lora.data.indexed import is_prefix
from megatron_lora.data.jsonl import iter_samples
from megatron_lora.data.preprocess import PreprocessError, prefix_files, preprocess
from megatron_lora.data.tokenizers import load_tokenizer
from tests.data.tiny_tokenizers import chatml_folder

LINES = [
    {"text": "plain text, loss everywhere"},
    {"prompt": "Q: reverse lamp", "response": " pmal"},
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "What colour is the sky?"},
                  {"role": "assistant", "content": "blue"},
                  {"role": "user", "content": "caf\u00e9?"},
                  {"role": "assistant", "content": "brown"}]},
]


def _jsonl(path, n=40, bad_at=()):
    """n lines cycling through LINES (line numbers in bad_at are not JSON), a blank line after
    the first; returns the path as a string."""
    with open(path, "w") as f:
        for i in range(n):
            if i + 1 in bad_at:
                f.write('{"text": oops}\n')
                continue
            line = dict(LINES[i % len(LINES)])
            if "text" in line:
                line["text"] = f"{line['text']} #{i}" + " more" * (i % 5)
            f.write(json.dumps(line) + "\n")
            if i == 0:
                f.write("\n")
    return str(path)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return chatml_folder(tmp_path_factory.mktemp("chatml"))


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tokens, targets = IndexedDataset(prefix), IndexedDataset(prefix + "_targets")
    return ([tokens[i].tolist() for i in range(len(tokens))],
            [targets[i].tolist() for i in range(len(targets))], tokens, targets)


@pytest.mark.parametrize("spec", ["byte", "chatml"])
def test_samples_and_targets_are_those_of_the_jsonl_path(tmp_path, spec, chatml):
    spec = chatml if spec == "chatml" else spec
    data = _jsonl(tmp_path / "d.jsonl")
    stats = preprocess([data], spec, str(tmp_path / "p"), progress_interval=-1)
    expected = [s for _, s in iter_samples(data, load_tokenizer(spec))]
    tokens, targets, tok_ds, _ = _read(str(tmp_path / "p"))
    assert tokens == [s.tokens for s in expected]
    assert targets == [s.loss_mask for s in expected]
    assert any(0 in t for t in targets) and any(1 in t for t in targets)  # SFT masks kept
    # One document per sample, as Megatron-LM's GPT datasets read documents.
    assert tok_ds.document_indices.tolist() == list(range(len(expected) + 1))
    assert tok_ds.index.dtype == np.uint16
    assert stats.samples == len(expected) == 40 and stats.lines == 40
    assert stats.tokens == sum(len(s.tokens) for s in expected)
    meta = json.loads((tmp_path / "p.json").read_text())
    assert meta["samples"] == 40 and meta["vocab_size"] == load_tokenizer(spec).vocab_size
    assert not [p for p in os.listdir(tmp_path) if ".partial-" in p]


def test_two_workers_write_the_same_bytes_as_one(tmp_path, chatml):
    data = _jsonl(tmp_path / "d.jsonl", n=90)
    preprocess([data, data], chatml, str(tmp_path / "one"), workers=1, chunk_lines=7,
               progress_interval=-1)
    preprocess([data, data], chatml, str(tmp_path / "two"), workers=2, chunk_lines=7,
               progress_interval=-1)
    for suffix in (".bin", ".idx", "_targets.bin", "_targets.idx"):
        one = (tmp_path / f"one{suffix}").read_bytes()
        assert one and one == (tmp_path / f"two{suffix}").read_bytes(), suffix
    assert len(_read(str(tmp_path / "one"))[0]) == 180


def test_a_bad_line_is_named_and_fatal_or_skipped_with_a_count(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", n=20, bad_at=(5, 12))
    with pytest.raises(PreprocessError) as exc:
        preprocess([data], "byte", str(tmp_path / "p"), chunk_lines=4, progress_interval=-1)
    # Line 6 of the file: the blank line after the first sample shifts it.
    assert f"{data}:6: not valid JSON" in str(exc.value) and "--skip-bad-lines" in str(exc.value)
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl"]  # nothing written, no temporary left
    stats = preprocess([data], "byte", str(tmp_path / "p"), skip_bad_lines=True, chunk_lines=4,
                       progress_interval=-1)
    assert stats.samples == 18 and len(stats.skipped) == 2
    assert stats.skipped[1].startswith(f"{data}:13: not valid JSON")
    assert len(_read(str(tmp_path / "p"))[0]) == 18


def test_an_existing_prefix_is_refused_without_overwrite(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", n=6)
    preprocess([data], "byte", str(tmp_path / "p"), progress_interval=-1)
    with pytest.raises(PreprocessError, match="pass --overwrite"):
        preprocess([data], "byte", str(tmp_path / "p"), progress_interval=-1)
    more = _jsonl(tmp_path / "e.jsonl", n=9)
    preprocess([more], "byte", str(tmp_path / "p"), overwrite=True, progress_interval=-1)
    assert len(_read(str(tmp_path / "p"))[0]) == 9


def test_a_failure_before_the_rename_leaves_no_prefix(tmp_path):
    data = _jsonl(tmp_path / "d.jsonl", n=6)

    def fail():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        preprocess([data], "byte", str(tmp_path / "p"), _before_rename=fail,
                   progress_interval=-1)
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl"]
    # Over an existing prefix (--overwrite): the old one is kept whole.
    preprocess([data], "byte", str(tmp_path / "p"), progress_interval=-1)
    before = {p: open(p, "rb").read() for p in prefix_files(str(tmp_path / "p"))}
    with pytest.raises(KeyboardInterrupt):
        preprocess([_jsonl(tmp_path / "e.jsonl", n=9)], "byte", str(tmp_path / "p"),
                   overwrite=True, _before_rename=fail, progress_interval=-1)
    assert before == {p: open(p, "rb").read() for p in prefix_files(str(tmp_path / "p"))}


def test_a_killed_run_leaves_no_prefix_that_train_accepts(tmp_path, monkeypatch):
    """SIGKILL at the worst moment, over an existing prefix: between the renames, with every
    new file but P.idx in place (a kill before the renames is the failure above, minus the
    clean-up of the temporary files)."""
    data = _jsonl(tmp_path / "d.jsonl", n=6)
    prefix = str(tmp_path / "p")
    preprocess([data], "byte", prefix, progress_interval=-1)
    for kill_after_renames in (4,):
        code = (
            "import os, signal, sys\n"
            "from megatron_lora.data import preprocess as P\n"
            f"n = [{kill_after_renames}]\n"
            "real = os.replace\n"
            "def replace(a, b):\n"
            "    if n[0] == 0:\n"
            "        os.kill(os.getpid(), signal.SIGKILL)\n"
            "    n[0] -= 1\n"
            "    real(a, b)\n"
            "P.os.replace = replace\n"
            f"P.preprocess([{data!r}], 'byte', {prefix!r}, overwrite=True, progress_interval=-1)\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120,
                              env=dict(os.environ, PYTHONWARNINGS="ignore"))
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
        assert not is_prefix(prefix) and not os.path.exists(prefix + ".idx")
        assert [p for p in os.listdir(tmp_path) if p.startswith("p.idx.partial-")]
    from megatron_lora.data import DataError
    from megatron_lora.data.sources import open_data

    with pytest.raises(DataError, match="neither a JSONL file nor an indexed dataset prefix"):
        open_data([prefix], load_tokenizer("byte"), 32, seed=1)
    # The next run at the prefix removes what the killed one left, and writes a whole prefix.
    preprocess([data], "byte", prefix, overwrite=True, progress_interval=-1)
    assert is_prefix(prefix) and not [p for p in os.listdir(tmp_path) if ".partial-" in p]


def test_no_samples_and_bad_arguments_are_errors(tmp_path):
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(PreprocessError, match="no samples"):
        preprocess([str(tmp_path / "blank.jsonl")], "byte", str(tmp_path / "p"),
                   progress_interval=-1)
    with pytest.raises(PreprocessError, match="--workers must be at least 1"):
        preprocess([str(tmp_path / "blank.jsonl")], "byte", str(tmp_path / "p"), workers=0)
    with pytest.raises(PreprocessError, match="--input .*missing.jsonl: no such file"):
        preprocess([str(tmp_path / "missing.jsonl")], "byte", str(tmp_path / "p"))
    with pytest.raises(PreprocessError, match="--output-prefix .*does not exist"):
        preprocess([str(tmp_path / "blank.jsonl")], "byte", str(tmp_path / "no" / "p"))
    assert sorted(os.listdir(tmp_path)) == ["blank.jsonl"]
