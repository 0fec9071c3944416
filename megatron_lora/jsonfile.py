"""Reading JSON that a user gave us (config.json, JSONL lines, token files, adapter_config.json).

Every failure becomes one exception whose message names where the JSON came from and what is
wrong with it: a file that cannot be opened (the OS reason, once, without the path repeated),
bytes that are not UTF-8 (the byte and its position), invalid JSON (the parser's reason and
position), and JSON nested so deeply that Python's parser runs out of recursion (a RecursionError
otherwise) or an integer too long to convert.

It sits at the package top level, importing nothing of megatron_lora, because every layer parses
user JSON: models (config.json), convert, data (JSONL), export (adapter_config.json) and cli (token
files). Callers pass `error=` their own exception class so their CLI's error handling still
applies.
"""

from __future__ import annotations

import json
import reprlib
from typing import Callable

ErrorType = Callable[[str], Exception]


class JSONInputError(ValueError):
    """User JSON that cannot be read or parsed; the message names the file (and line)."""


def os_reason(exc: OSError) -> str:
    """An OSError's reason without the file name (which the caller's message already gives)."""
    return exc.strerror or type(exc).__name__


def reason(exc: BaseException) -> str:
    """str(exc), or the exception's class name when its message is empty (EOFError(), ...)."""
    return str(exc) or type(exc).__name__


def decode_utf8(data: bytes, where: str, error: ErrorType = JSONInputError) -> str:
    """`data` as text; raise `error("{where}: not UTF-8 (byte 0x.. at line L, column N)")` if it
    is not (columns count bytes from 1; a single line, e.g. of a JSONL file, gives no line)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        single = b"\n" not in data.rstrip(b"\r\n")
        at = f"column {column}" if single else f"line {line}, column {column}"
        raise error(f"{where}: not UTF-8 (byte 0x{data[exc.start]:02x} at {at}); "
                    f"save it as UTF-8") from None


def loads(text: str, where: str, error: ErrorType = JSONInputError):
    """json.loads(text); every parse failure is `error` naming `where`."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        at = f"column {exc.colno}" if exc.lineno == 1 else f"line {exc.lineno} column {exc.colno}"
        raise error(f"{where}: not valid JSON ({exc.msg} at {at})") from None
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply to read (arrays/objects nested beyond "
                    f"Python's recursion limit)") from None
    except ValueError as exc:  # e.g. an integer literal longer than int() accepts
        raise error(f"{where}: cannot read JSON ({reason(exc)})") from None


def read_json(path: str, error: ErrorType = JSONInputError, what: str = "") -> object:
    """The parsed JSON file at `path`. `what` (e.g. "not a PEFT adapter folder") is added to the
    file-not-found message."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise error(f"{path}: file not found{f' ({what})' if what else ''}") from None
    except OSError as exc:
        raise error(f"{path}: cannot read: {os_reason(exc)}") from None
    return loads(decode_utf8(data, path, error), path, error)


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 60, 60


def short(value) -> str:
    """A short repr of a parsed JSON value for messages (bounded depth and length, so a deeply
    nested value cannot recurse)."""
    return _SHORT.repr(value)


def json_value(value) -> str:
    """How a parsed JSON value is written in JSON (null, true, "false", NaN), for messages that
    quote config.json; arrays and objects are shortened."""
    if isinstance(value, (list, dict)):
        kind = "an array" if isinstance(value, list) else "an object"
        return f"{kind} {short(value)}"
    if isinstance(value, str):
        return f"the string {json.dumps(value[:60])}"
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} digits)"


__all__ = ["JSONInputError", "decode_utf8", "json_value", "loads", "os_reason", "read_json",
           "reason", "short"]
