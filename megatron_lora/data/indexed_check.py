"""The whole of an indexed dataset's `.idx` checked against itself and its `.bin`, once, on open.

megatron-core's `IndexedDataset` trusts its index: a truncated or foreign `.idx` fails inside its
constructor (an AttributeError from its error path, a bare AssertionError), and a decreasing
document index, a negative or past-the-end sequence pointer or a float dtype is read as it is and
trained on. `check_index` reads the index in blocks of `_BLOCK` entries (by file offset, so the
pages read are not held in this process; numpy on each block, no Python loop per sequence: an
index can have 10^8 entries) and raises the DataError of the first problem, one line naming the
file. What must hold (megatron-core's layout, data/indexed_writer.py):

- `P.idx` and `P.bin` are regular files (data/files.py);
- the header: magic `MMIDIDX\\x00\\x00`, version 1, a dtype code among those given (token ids:
  megatron-core's integer codes; loss masks: uint8 only);
- the size: exactly 34 + 12 N + 8 D bytes for N sequences and D >= 1 document boundaries;
- every sequence length >= 0, every sequence's bytes [pointer, pointer + length * itemsize)
  inside `P.bin`, every pointer a multiple of the itemsize (whole ids: the vocabulary check,
  data/indexed.py `token_range`, reads the `.bin` on id boundaries);
- the document boundaries start at 0, never decrease and end at N.

`read_meta` reads `P.json`, refusing one that is not a regular file or not a JSON object, and
one of `megatron-lora preprocess` whose tokenizer fields have the wrong types.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np

from megatron_lora.data.files import open_regular, regular_file_problem
from megatron_lora.data.indexed_writer import DTYPE_CODES, INDEX_HEADER, INDEX_HEADER_BYTES
from megatron_lora.data.jsonl import DataError
from megatron_lora.jsonfile import decode_utf8, json_value, loads

CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
TOKEN_CODES = frozenset(c for c, d in CODE_DTYPES.items() if d.kind in "iu")
MASK_CODES = frozenset([DTYPE_CODES[np.dtype(np.uint8)]])
_BLOCK = 1 << 20  # index entries read and checked at a time
_AGAIN = "write the dataset again (megatron-lora preprocess)"


@dataclass
class IndexInfo:
    """What a checked `.idx` says: the values' dtype, N sequences, D document boundaries."""

    dtype: np.dtype
    sequences: int
    documents: int


def check_index(path: str, where: str, codes=TOKEN_CODES, what: str = "token ids") -> IndexInfo:
    """Check `path.idx` and `path.bin` (module docstring); `where` starts every message (e.g.
    "--data-path P"), `codes` are the dtype codes accepted for values that are `what`."""
    idx, bin_ = path + ".idx", path + ".bin"
    for name in (idx, bin_):
        problem = regular_file_problem(name)
        if problem is not None:
            raise DataError(f"{where}: cannot read {name}: {problem}")

    def fail(message: str) -> DataError:
        return DataError(f"{where}: {idx} {message}; {_AGAIN}")

    with open(idx, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < INDEX_HEADER_BYTES:
            raise fail("is empty" if size == 0 else
                       f"is truncated ({size} bytes, shorter than the {INDEX_HEADER_BYTES}-byte "
                       f"header)")
        header = f.read(INDEX_HEADER_BYTES)
        magic = header[:len(INDEX_HEADER)]
        version, code, n, docs = struct.unpack("<QBQQ", header[len(INDEX_HEADER):])
        if magic != INDEX_HEADER:
            raise fail(f"does not start with megatron-core's index header {INDEX_HEADER!r} "
                       f"(it starts with {magic!r}): not an indexed dataset index")
        if version != 1:
            raise fail(f"has version {version}; megatron-core's indexes have version 1")
        if code not in CODE_DTYPES:
            raise fail(f"has dtype code {code}, not one of megatron-core's "
                       f"({', '.join(map(str, sorted(CODE_DTYPES)))})")
        if code not in codes:
            allowed = ", ".join(f"{CODE_DTYPES[c]} ({c})" for c in sorted(codes))
            raise fail(f"holds {CODE_DTYPES[code]} values (dtype code {code}); {what} must be "
                       f"{allowed}")
        expected = INDEX_HEADER_BYTES + 12 * n + 8 * docs
        if size != expected:
            raise fail(f"is {size} bytes, but its header's {n} sequences and {docs} document "
                       f"boundaries take {expected}: it is truncated or its counts are wrong")
        if docs < 1:
            raise fail("has no document boundaries (its document count is 0)")
        dtype = CODE_DTYPES[code]
        _check_sequences(f.fileno(), n, dtype.itemsize, os.path.getsize(bin_), bin_, fail)
        _check_documents(f.fileno(), n, docs, fail)
    return IndexInfo(dtype, n, docs)


def _read(fd: int, dtype, count: int, offset: int) -> np.ndarray:
    data = os.pread(fd, count * np.dtype(dtype).itemsize, offset)
    return np.frombuffer(data, dtype=dtype)


def _check_sequences(fd: int, n: int, itemsize: int, bin_size: int, bin_: str, fail) -> None:
    for a in range(0, n, _BLOCK):
        count = min(_BLOCK, n - a)
        lengths = _read(fd, np.int32, count, INDEX_HEADER_BYTES + 4 * a)
        pointers = _read(fd, np.int64, count, INDEX_HEADER_BYTES + 4 * n + 8 * a)
        bad = np.flatnonzero(lengths < 0)
        if bad.size:
            i = int(bad[0])
            raise fail(f"gives sequence {a + i} the length {int(lengths[i])} (below 0)")
        # pointer + bytes <= bin_size, written so that no int64 sum can overflow
        bad = np.flatnonzero((pointers < 0) | (pointers > bin_size)
                             | (lengths.astype(np.int64) * itemsize > bin_size - pointers))
        if bad.size:
            i = int(bad[0])
            start, stop = int(pointers[i]), int(pointers[i]) + int(lengths[i]) * itemsize
            raise fail(f"places sequence {a + i} at bytes {start}..{stop} of {bin_}, outside its "
                       f"{bin_size} bytes")
        # a pointer between two ids reads each id from the bytes of two: other ids, unchecked
        # by the vocabulary check, which reads the .bin on id boundaries
        bad = np.flatnonzero(pointers % itemsize)
        if bad.size:
            i = int(bad[0])
            raise fail(f"places sequence {a + i} at byte {int(pointers[i])} of {bin_}, not a "
                       f"multiple of its {itemsize}-byte ids (the index does not belong to "
                       f"this .bin, or is damaged)")


def _check_documents(fd: int, n: int, docs: int, fail) -> None:
    offset, previous = INDEX_HEADER_BYTES + 12 * n, None
    for a in range(0, docs, _BLOCK):
        block = _read(fd, np.int64, min(_BLOCK, docs - a), offset + 8 * a)
        if previous is None and int(block[0]) != 0:
            raise fail(f"has document boundaries starting at {int(block[0])}, not 0")
        steps = np.diff(block, prepend=block[:1] if previous is None else previous)
        bad = np.flatnonzero(steps < 0)
        if bad.size:
            i = int(bad[0])
            raise fail(f"has decreasing document boundaries (boundary {a + i} is "
                       f"{int(block[i])}, after {int(block[i] - steps[i])})")
        previous = block[-1:]
    if int(previous[0]) != n:
        raise fail(f"has document boundaries ending at {int(previous[0])}, not at its {n} "
                   f"sequences")


_META_TYPES = {"vocab_size": (int,), "bos_id": (int, type(None)), "eos_id": (int,),
               "pad_id": (int,)}


def read_meta(prefix: str, flag: str, format_name: str) -> Optional[dict]:
    """`P.json` when `megatron-lora preprocess` wrote it (its "format" is `format_name`), None
    without one or for another tool's JSON object; DataError for one that is not a regular
    file, not a JSON object, or whose tokenizer fields have the wrong types."""
    path = prefix + ".json"
    if not os.path.lexists(path):
        return None
    where = f"{flag} {prefix}: {path}"
    with open_regular(path, DataError, where) as f:
        try:
            data = f.read()
        except OSError as exc:
            raise DataError(f"{where}: cannot read ({exc.strerror})") from None
    meta = loads(decode_utf8(data, where, DataError), where, DataError)
    if not isinstance(meta, dict):
        raise DataError(f"{where}: expected a JSON object (what `megatron-lora preprocess` "
                        f"writes), got {type(meta).__name__}; remove it or preprocess again")
    if meta.get("format") != format_name:
        return None  # another tool's P.json: a plain Megatron-LM prefix
    for key, types in _META_TYPES.items():
        value = meta.get(key)
        if not isinstance(value, types) or isinstance(value, bool):
            kinds = " or ".join("null" if t is type(None) else "an integer" for t in types)
            raise DataError(f"{where}: '{key}' must be {kinds}, got {json_value(value)}; run "
                            f"`megatron-lora preprocess` again")
    return meta


__all__ = ["CODE_DTYPES", "IndexInfo", "MASK_CODES", "TOKEN_CODES", "check_index", "read_meta"]
