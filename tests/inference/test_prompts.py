"""Prompts files and `generate`'s input checks: bad input exits 2 before any collective with the
file and line or the flag named, and nothing is written."""

import json
import os

import pytest

from megatron_lora.cli import main
from megatron_lora.data.tokenizers import ByteTokenizer
from megatron_lora.inference.prompts import PromptError, prompt_ids, read_prompts
from tests.convert.tiny import make_tiny_mixtral


def _write(path, lines):
    with open(path, "w") as f:
        f.writelines(line + "\n" for line in lines)
    return str(path)


@pytest.mark.parametrize("lines,match", [
    (["{\"prompt\": \"a\"}", "not json"], r"p\.jsonl:2: not valid JSON"),
    (["[1, 2]"], r"p\.jsonl:1: expected a JSON object"),
    (["{\"text\": \"a\"}"], r"'prompt' \(text\) or 'messages'"),
    (["{\"prompt\": \"\"}"], r"'prompt' must be a non-empty string"),
    (["{\"messages\": [{\"role\": \"user\"}]}"], r"'messages' must be a non-empty list"),
    (["", "  "], r"no prompts"),
])
def test_bad_prompts_files_name_file_and_line(tmp_path, lines, match):
    with pytest.raises(PromptError, match=match):
        read_prompts(_write(tmp_path / "p.jsonl", lines))


def test_prompt_ids_byte_tokenizer_and_messages_without_template(tmp_path):
    tok = ByteTokenizer()
    records = read_prompts(_write(tmp_path / "p.jsonl", [
        json.dumps({"prompt": "hi", "extra": 1}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}]})]))
    assert prompt_ids(tok, records[0], "p:1") == [tok.bos_id, ord("h"), ord("i")]
    with pytest.raises(PromptError, match="p:2: 'messages' need a tokenizer with a chat template"):
        prompt_ids(tok, records[1], "p:2")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny Mixtral (vocabulary 250) and a tokenizer folder within its vocabulary."""
    from tests.data.tiny_tokenizers import mistral_folder

    root = tmp_path_factory.mktemp("gen_inputs")
    make_tiny_mixtral(str(root / "hf"), seed=1)
    return str(root / "hf"), mistral_folder(str(root / "tok"), vocab_size=240)


@pytest.mark.parametrize("extra,match", [
    (["--top-p", "0"], r"--top-p must be in \(0, 1\]"),
    (["--temperature", "-1"], r"--temperature must be >= 0"),
    (["--max-new-tokens", "200"], r"p\.jsonl:1: \d+ prompt tokens \+ --max-new-tokens 200 "
                                  r"exceed the model's max_position_embeddings=128"),
    (["--tokenizer", "byte"], r"p\.jsonl:1: token id 256 from --tokenizer byte must satisfy "
                              r"0 <= id < 250"),
])
def test_generate_refuses_bad_input_before_starting(hf, tmp_path, capsys, extra, match):
    model, tok = hf
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "Hello there"})])
    out = tmp_path / "out.jsonl"
    args = ["generate", "--load-hf", model, "--tokenizer", tok, "--prompts", prompts,
            "--out", str(out)] + extra  # a later --tokenizer wins
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "megatron-lora generate: error:" in err and "Traceback" not in err
    import re

    assert re.search(match, err), err
    assert not os.path.exists(out)


def test_a_fifo_as_prompts_is_refused_without_opening_it(tmp_path):
    """A FIFO would block the open until something writes to it: checked in a thread with a
    timeout, so a regression fails instead of hanging."""
    import threading

    path = str(tmp_path / "p.jsonl")
    os.mkfifo(path)
    result = {}

    def run():
        try:
            read_prompts(path)
        except PromptError as exc:
            result["error"] = str(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(30)
    if worker.is_alive():
        with open(path, "wb"):
            pass
        pytest.fail("read_prompts blocked on a FIFO")
    assert result["error"] == (f"{path}: cannot read the prompts file (a FIFO (named pipe), not "
                               f"a regular file)")


def test_a_runaway_chat_template_fails_the_prompt_within_seconds(tmp_path):
    """generate renders each 'messages' prompt with the template: bounded like preprocess."""
    import time

    from megatron_lora.data.chat_limits import MAX_RENDER_SECONDS
    from megatron_lora.data.tokenizers import load_tokenizer
    from tests.data.tiny_tokenizers import template_folder

    folder = template_folder(str(tmp_path / "tok"), "{% for i in range(99999) %}"
                             "{% for j in range(99999) %}x{% endfor %}{% endfor %}")
    tok = load_tokenizer(folder)
    start = time.monotonic()
    with pytest.raises(PromptError, match=rf"^p\.jsonl:1: the chat template of {folder}/"
                                          r"tokenizer_config\.json cannot be used: "):
        prompt_ids(tok, {"messages": [{"role": "user", "content": "hi"}]}, "p.jsonl:1")
    assert time.monotonic() - start < MAX_RENDER_SECONDS + 3
