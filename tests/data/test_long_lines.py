"""A line longer than MAX_LINE_BYTES (data/jsonl.py) is refused, naming the file and line,
before any tokenizer sees it, in train's reader, `preprocess` (fatal, or skipped with
--skip-bad-lines, no temporary file left), `data-preview` and `generate`'s prompts. The Rust
tokenizer aborted the process on a 200 MB line (exit 134, `.partial` files left); here the bound
is lowered to 1000 bytes so that the lines stay small."""

import json
import os

import pytest

from megatron_lora.data import jsonl
from megatron_lora.data.jsonl import DataError, iter_samples
from megatron_lora.data.preprocess import PreprocessError, preprocess
from megatron_lora.data.tokenizers import load_tokenizer

LIMIT = 1000


@pytest.fixture
def low_bound(monkeypatch):
    monkeypatch.setattr(jsonl, "MAX_LINE_BYTES", LIMIT, raising=False)


def _data(path, long_at: int, long_bytes: int = 5 * LIMIT, n: int = 6) -> str:
    """n prompt/response lines; line `long_at` (1-based) a text sample of `long_bytes` bytes."""
    with open(path, "w") as f:
        for i in range(1, n + 1):
            if i == long_at:
                f.write(json.dumps({"text": "x" * (long_bytes - 12)}) + "\n")
            else:
                f.write(json.dumps({"prompt": f"q{i} ", "response": f"a{i}"}) + "\n")
    return str(path)


def test_the_train_reader_refuses_a_long_line_naming_it(tmp_path, low_bound):
    data = _data(tmp_path / "d.jsonl", long_at=4)
    with pytest.raises(DataError) as err:
        list(iter_samples(data, load_tokenizer("byte")))
    assert str(err.value) == (f"{data}:4: the line is longer than {LIMIT} bytes "
                              f"(MAX_LINE_BYTES, one sample); split or shorten it")


def test_a_line_of_exactly_the_bound_is_read(tmp_path, low_bound):
    data = _data(tmp_path / "d.jsonl", long_at=2, long_bytes=LIMIT)
    samples = list(iter_samples(data, load_tokenizer("byte")))
    assert [w for w, _ in samples] == [f"{data}:{i}" for i in range(1, 7)]
    assert len(samples[1][1].tokens) == LIMIT - 12 + 2  # bos, the text's bytes, eos


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_refuses_or_skips_a_long_line_leaving_no_partial(tmp_path, low_bound,
                                                                    workers):
    data = _data(tmp_path / "d.jsonl", long_at=3)
    with pytest.raises(PreprocessError, match=rf"^{data}:3: the line is longer than {LIMIT} "
                                              r"bytes .*--skip-bad-lines"):
        preprocess([data], "byte", str(tmp_path / "p"), workers=workers, chunk_lines=2,
                   progress_interval=-1)
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl"]
    stats = preprocess([data], "byte", str(tmp_path / "p"), workers=workers, chunk_lines=2,
                       skip_bad_lines=True, progress_interval=-1)
    assert stats.samples == 5 and len(stats.skipped) == 1 and f"{data}:3: " in stats.skipped[0]
    assert stats.bytes_read == os.path.getsize(data)


def test_data_preview_exits_2_naming_the_line(tmp_path, low_bound, capsys):
    from megatron_lora.cli import main

    data = _data(tmp_path / "d.jsonl", long_at=1)
    assert main(["data-preview", "--data-path", data, "--tokenizer", "byte",
                 "--seq-length", "16"]) == 2
    err = capsys.readouterr().err
    assert f"{data}:1: the line is longer than {LIMIT} bytes" in err and "Traceback" not in err


def test_a_long_prompt_is_refused_naming_the_line(tmp_path, low_bound):
    from megatron_lora.inference.prompts import PromptError, read_prompts

    path = tmp_path / "p.jsonl"
    long = json.dumps({"prompt": "é" * LIMIT}, ensure_ascii=False)  # 1000 characters, 2000 bytes
    path.write_text(json.dumps({"prompt": "hi"}) + "\n" + long + "\n", encoding="utf-8")
    with pytest.raises(PromptError, match=rf"^{path}:2: the line is longer than {LIMIT} bytes"):
        read_prompts(str(path))
    path.write_text(json.dumps({"prompt": "é" * (LIMIT // 2 - 10)}, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    assert len(read_prompts(str(path))) == 1
