"""Bad training data, token files and tokenizers: a clear error naming the file (and line or
position), never a UnicodeDecodeError, RecursionError or OverflowError traceback."""

import json
import os

import pytest

from megatron_lora.cli.logits import read_tokens
from megatron_lora.convert.errors import ConversionError
from megatron_lora.data import ByteTokenizer, DataError, read_jsonl
from megatron_lora.data.tokenizers import TokenizerError, load_tokenizer

DEEP = "[" * 100000 + "]" * 100000


def _jsonl(tmp_path, lines: bytes):
    path = tmp_path / "data.jsonl"
    path.write_bytes(lines)
    return str(path)


def test_non_utf8_line_names_file_line_byte_and_column(tmp_path):
    path = _jsonl(tmp_path, b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError) as info:
        read_jsonl(path, ByteTokenizer(), max_tokens=64)
    assert str(info.value) == f"{path}:2: not UTF-8 (byte 0xe9 at column 14); save it as UTF-8"


@pytest.mark.parametrize("line", [DEEP, '{"text": ' + DEEP + "}",
                                  '{"messages": [{"role": "user", "content": ' + DEEP + "}]}"])
def test_deeply_nested_line_is_a_data_error(tmp_path, line):
    path = _jsonl(tmp_path, b'{"text": "fine"}\n' + line.encode() + b"\n")
    with pytest.raises(DataError, match=f"{path}:2: JSON nested too deeply"):
        read_jsonl(path, ByteTokenizer(), max_tokens=64)


def test_moderately_nested_message_is_quoted_briefly(tmp_path):
    """Nesting under the parser's limit: the message quotes a bounded repr of the bad turn."""
    turn = {"role": "user", "content": json.loads("[" * 500 + "]" * 500)}
    path = _jsonl(tmp_path, json.dumps({"messages": [turn]}).encode() + b"\n")
    with pytest.raises(DataError) as info:
        read_jsonl(path, ByteTokenizer(), max_tokens=64)
    msg = str(info.value)
    assert msg.startswith(f"{path}:1: messages[0] must be") and len(msg) < len(path) + 200, msg


def test_missing_data_file_names_it_once(tmp_path):
    path = str(tmp_path / "none.jsonl")
    with pytest.raises(DataError) as info:
        read_jsonl(path, ByteTokenizer(), max_tokens=64)
    assert str(info.value) == f"{path}: cannot read: No such file or directory"


def _tokens(tmp_path, text):
    path = tmp_path / "tokens.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


@pytest.mark.parametrize("ids,message", [
    ([[1, 2], [3, 2 ** 70]], "token id [1][1] = 1180591620717411303424 is outside the model's "
                             "vocabulary: ids must satisfy 0 <= id < 250"),
    ([[1, 2], [-1, 3]], "token id [1][0] = -1 is outside the model's vocabulary: ids must "
                        "satisfy 0 <= id < 250"),
    ([[250]], "token id [0][0] = 250 is outside the model's vocabulary: ids must satisfy "
              "0 <= id < 250"),
])
def test_token_ids_out_of_range_name_file_and_position(tmp_path, ids, message):
    path = _tokens(tmp_path, json.dumps(ids))
    with pytest.raises(ConversionError) as info:
        read_tokens(path, 250)
    assert str(info.value) == f"{path}: {message}"


@pytest.mark.parametrize("text,message", [
    (DEEP, "JSON nested too deeply"),
    (b"[[1, 2]]\xff", "not UTF-8 (byte 0xff at column 9)"),
    ("[[1, 2]", "not valid JSON (Expecting ',' delimiter at column 8)"),
])
def test_unreadable_token_files(tmp_path, text, message):
    path = _tokens(tmp_path, text)
    with pytest.raises(ConversionError) as info:
        read_tokens(path, 250)
    assert str(info.value).startswith(f"{path}: {message}"), str(info.value)


def test_missing_token_file_names_the_path_once(tmp_path):
    path = str(tmp_path / "none.json")
    with pytest.raises(ConversionError) as info:
        read_tokens(path, 250)
    assert str(info.value) == f"{path}: file not found"


def test_good_tokens_still_read(tmp_path):
    tokens = read_tokens(_tokens(tmp_path, "[[0, 249], [7, 8]]"), 250)
    assert tokens.tolist() == [[0, 249], [7, 8]] and str(tokens.dtype) == "torch.int64"


@pytest.mark.parametrize("text", [b'{"model": ', b"\xff\xfe{}", DEEP.encode()])
def test_broken_tokenizer_json_is_a_value_error_naming_it(tmp_path, text):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(text)
    with pytest.raises(TokenizerError, match=f"^{path}: not a readable tokenizer.json \\(.+\\)$"):
        load_tokenizer(str(path))


def _not_blocking(call, unblock_path=None, seconds=30):
    """call() in a thread, failing the test (not hanging it) when it does not return in time;
    a FIFO it blocks on is then opened for writing, so the thread can end."""
    import threading

    result = {}

    def run():
        try:
            result["value"] = call()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        if unblock_path is not None:
            with open(unblock_path, "wb"):
                pass
        pytest.fail(f"blocked for {seconds} s")
    return result


@pytest.fixture
def fifo(tmp_path):
    path = str(tmp_path / "data.jsonl")
    os.mkfifo(path)
    return path


def test_a_fifo_or_device_as_data_is_refused_without_reading(fifo):
    """A FIFO would block the open; /dev/zero would be read without end (one line, no newline)."""
    for path, kind in ((fifo, "a FIFO (named pipe)"), ("/dev/zero", "a character device")):
        result = _not_blocking(lambda: read_jsonl(path, ByteTokenizer(), max_tokens=64), fifo)
        assert isinstance(result.get("error"), DataError), result
        assert str(result["error"]) == f"{path}: cannot read: {kind}, not a regular file"


def test_a_symlink_to_a_fifo_is_refused_too(fifo, tmp_path):
    link = str(tmp_path / "link.jsonl")
    os.symlink(fifo, link)
    result = _not_blocking(lambda: read_jsonl(link, ByteTokenizer(), max_tokens=64), fifo)
    assert str(result["error"]) == f"{link}: cannot read: a FIFO (named pipe), not a regular file"


@pytest.mark.parametrize("command", ["preprocess", "data-preview", "train"])
def test_commands_refuse_a_fifo_as_data_in_one_line(fifo, tmp_path, capsys, command):
    from megatron_lora.cli import main

    if command == "train":  # read before the model is built: the data checks come first
        from megatron_lora.data.sources import open_data

        result = _not_blocking(lambda: open_data([fifo], ByteTokenizer(), 32, seed=1), fifo)
        assert str(result["error"]) == f"{fifo}: cannot read: a FIFO (named pipe), not a " \
                                       f"regular file"
        return
    argv = (["preprocess", "--input", fifo, "--tokenizer", "byte", "--output-prefix",
             str(tmp_path / "out")] if command == "preprocess" else
            ["data-preview", "--data-path", fifo, "--tokenizer", "byte", "--seq-length", "32"])
    result = _not_blocking(lambda: main(argv), fifo)
    assert result.get("value") == 2, result
    flag = "--input " if command == "preprocess" else ""
    assert capsys.readouterr().err == (f"megatron-lora {command}: error: {flag}{fifo}: cannot "
                                       f"read: a FIFO (named pipe), not a regular file\n")
