"""`megatron-lora data-preview`: the samples as train reads them, loss-masked runs marked, counts;
bad input is exit 2 with one message. Run through main in this process (no torch.distributed)."""

import json

import pytest

from megatron_lora.cli import main
from megatron_lora.cli.data_preview import LEGEND
from megatron_lora.data import read_jsonl
from megatron_lora.data.tokenizers import load_tokenizer
from tests.data.tiny_tokenizers import chatml_folder

LINES = [
    {"messages": [{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": "What colour is the sky?"},
                  {"role": "assistant", "content": "blue"},
                  {"role": "user", "content": "caf\u00e9?"},
                  {"role": "assistant", "content": "brown\nish"}]},
    {"prompt": "Q: lamp", "response": " pmal"},
    {"text": "x" * 40},
]


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    return str(path)


def _preview(capsys, *argv):
    code = main(["data-preview", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_byte_tokenizer_preview_is_exact(capsys, data):
    code, out, _ = _preview(capsys, "--data-path", data, "--tokenizer", "byte",
                            "--seq-length", "30", "--samples", "2", "--count-all")
    assert code == 0
    assert out == "\n".join([
        "tokenizer: byte (259 tokens); messages: Mistral [INST] format (the tokenizer has no "
        "chat template)",
        LEGEND,
        "",
        f"{data}:1: 31 tokens, 0 trained, truncated (cut 63 of 94); skipped by train (nothing to "
        "train on)",
        '  .    31 "<s>[INST] Answer briefly.\\n\\nWhat c"',
        "",
        f"{data}:2: 14 tokens, 6 trained, not truncated",
        '  .     8 "<s>Q: lamp"',
        '  +     6 " pmal</s>"',
        "",
        "shown: 2 samples, 45 tokens, 6 trained, 1 truncated (to --seq-length+1 = 31 tokens)",
        "file: 3 samples, 2 truncated, 1 skipped (nothing to train on after truncation)",
        "",
    ])


def test_chat_template_preview_marks_what_train_trains(capsys, data, tmp_path):
    """The '+' runs are the assistant turns, and the counts are those of the samples train reads
    (read_jsonl at the same --seq-length)."""
    folder = chatml_folder(str(tmp_path / "tok"))
    code, out, _ = _preview(capsys, "--data-path", data, "--tokenizer", folder,
                            "--seq-length", "200")
    assert code == 0 and LEGEND in out and "chat template of" in out
    lines = out.splitlines()
    trained = [json.loads(line.split(maxsplit=2)[2]) for line in lines if line.startswith("  +")]
    assert trained[:2] == ["blue<|im_end|>", "brown\nish<|im_end|>"]
    masked = "".join(json.loads(line.split(maxsplit=2)[2]) for line in lines
                     if line.startswith("  ."))
    assert "Answer briefly." in masked and "caf\u00e9?" in masked and "blue" not in masked
    samples, _ = read_jsonl(data, load_tokenizer(folder), max_tokens=201)
    first = samples[0]
    assert f"{data}:1: {len(first.tokens)} tokens, {sum(first.loss_mask[1:])} trained, " \
           f"not truncated" in lines
    total = sum(len(s.tokens) for s in samples)
    assert lines[-1].startswith(f"shown: 3 samples, {total} tokens, "
                                f"{sum(sum(s.loss_mask[1:]) for s in samples)} trained, 0 truncated")


@pytest.mark.parametrize("argv,message", [
    (["--seq-length", "0"], "--seq-length must be at least 1, got 0"),
    (["--seq-length", "8", "--samples", "-1"], "--samples must be 0 or more, got -1"),
    (["--seq-length", "8", "--tokenizer", "missing-dir"], "--tokenizer 'missing-dir': expected"),
])
def test_bad_arguments_exit_2_naming_the_flag(capsys, data, argv, message):
    argv = ["--tokenizer", "byte", *argv] if "--tokenizer" not in argv else argv
    code, out, err = _preview(capsys, "--data-path", data, *argv)
    assert code == 2 and err.startswith(f"megatron-lora data-preview: error: {message}"), err


def test_bad_data_names_file_and_line(capsys, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"messages": []}\n')
    code, _, err = _preview(capsys, "--data-path", str(path), "--tokenizer", "byte",
                            "--seq-length", "8", "--count-all")
    assert code == 2
    assert err == f"megatron-lora data-preview: error: {path}:2: 'messages' must be a non-empty " \
                  f"list\n"
