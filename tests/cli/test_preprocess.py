"""`megatron-lora preprocess` as a user runs it (through main, in this process), and `train
--data-path` taking its prefix or a weighted blend (train's setup, before any collective)."""

import json
import os

import pytest
import torch
import torch.distributed as dist

from megatron_lora.cli import build_parser, main


def _run(capsys, *argv):
    code = main(["preprocess", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f" a{i}"}) + "\n"
                            for i in range(30)))
    return str(path)


def test_preprocess_writes_a_prefix_and_reports_it(capsys, data, tmp_path):
    prefix = str(tmp_path / "out")
    code, out, err = _run(capsys, "--input", data, "--tokenizer", "byte", "--output-prefix",
                          prefix, "--workers", "2", "--chunk-lines", "4", "--log-interval", "0")
    assert code == 0, err
    assert out.startswith(f"wrote {prefix}.bin/.idx and {prefix}_targets.bin/.idx: 30 samples, ")
    assert "0 bad lines skipped" in out and "2 workers" in out
    assert "preprocess: 30 samples" in err and "samples/s" in err and "MiB read (100%)" in err
    assert all(os.path.isfile(prefix + s) for s in (".bin", ".idx", "_targets.bin",
                                                     "_targets.idx", ".json"))
    code, _, err = _run(capsys, "--input", data, "--tokenizer", "byte", "--output-prefix", prefix)
    assert code == 2 and "already exist" in err and "pass --overwrite" in err


def test_an_input_that_is_one_of_the_outputs_is_refused_even_with_overwrite(capsys, data,
                                                                           tmp_path):
    source = tmp_path / "train.json"  # JSONL under a .json name: the prefix's P.json
    source.write_text(open(data).read())
    before = source.read_bytes()
    code, out, err = _run(capsys, "--input", str(source), "--tokenizer", "byte",
                          "--output-prefix", str(tmp_path / "train"), "--overwrite")
    assert code == 2 and out == ""
    assert err == (f"megatron-lora preprocess: error: --input {source} is one of the files of "
                   f"--output-prefix {tmp_path / 'train'}; choose another prefix\n")
    assert source.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["d.jsonl",
                                                                              "train.json"]


def test_bad_lines_exit_2_naming_file_and_line_or_are_skipped(capsys, data, tmp_path):
    with open(data, "a") as f:
        f.write('{"prompt": 1, "response": "x"}\n')
    prefix = str(tmp_path / "out")
    code, out, err = _run(capsys, "--input", data, "--tokenizer", "byte", "--output-prefix",
                          prefix, "--log-interval", "-1")
    assert code == 2 and out == ""
    assert err == (f"megatron-lora preprocess: error: {data}:31: 'prompt' and 'response' must "
                   f"both be strings (pass --skip-bad-lines to skip bad lines)\n")
    code, out, err = _run(capsys, "--input", data, "--tokenizer", "byte", "--output-prefix",
                          prefix, "--skip-bad-lines", "--log-interval", "-1")
    assert code == 0 and "30 samples" in out and "1 bad lines skipped" in out
    assert err == f"skipped: {data}:31: 'prompt' and 'response' must both be strings\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_example):
    return tiny_example(tmp_path_factory.mktemp("tiny_pp"), samples=24)


def _setup(tiny, *data_path, extra=()):
    from megatron_lora.runtime import ParallelLayout
    from megatron_lora.cli.train_run import _setup_checks

    args = build_parser().parse_args(
        ["train", "--load-hf", os.path.join(tiny, "hf"), "--data-path", *data_path,
         "--tokenizer", "byte", "--seq-length", "32", "--global-batch-size", "4",
         "--train-iters", "2", *extra])
    out = _setup_checks(args, ParallelLayout(), 1)
    assert not dist.is_initialized()
    return out[5]  # (train, evaluation, stats)


def test_train_reads_a_prefix_and_a_blend(capsys, tiny, tmp_path):
    jsonl = os.path.join(tiny, "data.jsonl")
    prefix = str(tmp_path / "tiny")
    assert _run(capsys, "--input", jsonl, "--tokenizer", "byte", "--output-prefix", prefix)[0] == 0
    train_j, _, stats_j = _setup(tiny, jsonl)
    train_p, held_p, stats_p = _setup(tiny, prefix)
    assert stats_p == stats_j and held_p is None
    for pos in (0, 4, 20):
        assert torch.equal(train_p.batch(pos, 4).tokens, train_j.batch(pos, 4).tokens)
    train_b, held_b, stats_b = _setup(tiny, "0.5", prefix, "0.5", jsonl,
                                      extra=("--eval-fraction", "0.25"))
    assert stats_b["samples"] == 2 * stats_j["samples"] and len(held_b) > 0
    from megatron_lora.cli.train_run import TrainSetupError

    with pytest.raises(TrainSetupError, match="--data-path: expected one path, or weight-path"):
        _setup(tiny, "0.5", prefix, jsonl)
    train_s, held_s, stats_s = _setup(tiny, prefix, extra=("--split", "80,20,0",
                                                            "--eval-interval", "1"))
    assert len(train_s) + len(held_s) == stats_j["sequences"] and len(held_s) > 0
    assert stats_s["held_out"] == len(held_s)
    with pytest.raises(TrainSetupError, match="--split 98,2 and --eval-fraction all give"):
        _setup(tiny, prefix, extra=("--split", "98,2", "--eval-fraction", "0.1"))
    with pytest.raises(TrainSetupError, match="--split 'x': expected up to three"):
        _setup(tiny, prefix, extra=("--split", "x"))
    os.unlink(prefix + ".idx")  # what a killed preprocess leaves: no prefix
    with pytest.raises(TrainSetupError, match="neither a JSONL file nor an indexed dataset"):
        _setup(tiny, prefix)


@pytest.fixture
def single_rank_env(monkeypatch):
    """A plain one-process run's environment, restored after the test (`train` sets the
    torchrun variables it finds missing)."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", str(29900 + os.getpid() % 90))):
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("flag", ["--data-path", "--valid-data-path"])
def test_train_refuses_a_damaged_prefix_in_one_line(capsys, tiny, tmp_path, single_rank_env,
                                                    flag):
    """A decreasing document index in P.idx: exit 2, one line naming the flag and the file,
    before any process group (megatron-core's reader would train on it, or fail with a bare
    AssertionError when the last boundary is off)."""
    import struct

    jsonl = os.path.join(tiny, "data.jsonl")
    prefix = str(tmp_path / "tiny")
    assert _run(capsys, "--input", jsonl, "--tokenizer", "byte", "--output-prefix", prefix)[0] == 0
    with open(prefix + ".idx", "r+b") as f:
        n = struct.unpack("<Q", f.read(26)[18:26])[0]
        f.seek(34 + 12 * n + 16)  # document boundary 2 (of 0, 1, 2, ...) becomes 0
        f.write(struct.pack("<q", 0))
    data = [jsonl, "--valid-data-path", prefix] if flag == "--valid-data-path" else [prefix]
    code = main(["train", "--load-hf", os.path.join(tiny, "hf"), "--data-path", *data,
                 "--tokenizer", "byte", "--seq-length", "32", "--global-batch-size", "4",
                 "--train-iters", "1", "--save", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err == (
        f"megatron-lora train: error: {flag} {prefix}: {prefix}.idx has decreasing document "
        f"boundaries (boundary 2 is 0, after 1); write the dataset again (megatron-lora "
        f"preprocess)\n"), err
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


def _chat_data(tmp_path, template):
    from tests.data.tiny_tokenizers import template_folder

    folder = template_folder(str(tmp_path / "tok"), template)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}) + "\n"
        for i in range(5)))
    return folder, str(path)


@pytest.mark.parametrize("command", ["preprocess", "data-preview"])
def test_a_runaway_chat_template_is_one_line_within_seconds(capsys, tmp_path, command):
    """Nested loops of 10^10 iterations that write nothing: stopped by MAX_RENDER_SECONDS, one
    message naming the line and the template's file (the old code ran until killed)."""
    import time

    from megatron_lora.data.chat_limits import MAX_RENDER_SECONDS

    folder, data = _chat_data(tmp_path, "{% for i in range(99999) %}{% for j in range(99999) %}"
                                        "{% endfor %}{% endfor %}")
    argv = (["preprocess", "--input", data, "--output-prefix", str(tmp_path / "out"),
             "--log-interval", "-1"] if command == "preprocess" else
            ["data-preview", "--data-path", data, "--seq-length", "32"])
    start = time.monotonic()
    code = main([*argv, "--tokenizer", folder])
    seconds = time.monotonic() - start
    err = capsys.readouterr().err
    assert code == 2 and seconds < MAX_RENDER_SECONDS + 10, (code, seconds)
    assert err == (f"megatron-lora {command}: error: {data}:1: the chat template of {folder}/"
                   f"tokenizer_config.json cannot be used: rendering took longer than "
                   f"{MAX_RENDER_SECONDS:g} s (MAX_RENDER_SECONDS)\n")


@pytest.mark.parametrize("template,message", [
    ([{"name": "default", "template": 3}], "'chat_template' must be a string or a list of "
                                           "{'name': str, 'template': str}"),
    ("{% extends 'base.jinja' %}", "the chat template does not compile: {% extends %} loads "
                                   "another template, which a chat template cannot do (line 1)"),
])
def test_preprocess_with_an_unusable_chat_template_exits_2_in_one_line(capsys, tmp_path,
                                                                        template, message):
    folder, data = _chat_data(tmp_path, template)
    code, out, err = _run(capsys, "--input", data, "--tokenizer", folder, "--output-prefix",
                          str(tmp_path / "out"))
    assert code == 2 and out == ""
    assert err == (f"megatron-lora preprocess: error: --tokenizer {folder}: {folder}/"
                   f"tokenizer_config.json: {message}\n")


def test_preprocess_refuses_a_template_that_renders_nothing(capsys, tmp_path):
    folder, data = _chat_data(tmp_path, "{% for m in messages %}\n{% endfor %}")
    code, out, err = _run(capsys, "--input", data, "--tokenizer", folder, "--output-prefix",
                          str(tmp_path / "out"), "--skip-bad-lines")
    assert code == 2 and out == "" and sorted(os.listdir(tmp_path)) == ["chat.jsonl", "tok"]
    assert err == (f"megatron-lora preprocess: error: --input {data}: no samples (5 bad lines "
                   f"skipped, the first: {data}:1: the chat template of {folder}/"
                   f"tokenizer_config.json rendered only whitespace for this conversation, no "
                   f"tokens to train on)\n")
