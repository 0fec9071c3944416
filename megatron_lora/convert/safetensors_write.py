"""Write safetensors files tensor by tensor, without holding a whole file's tensors in memory.

The safetensors format is: 8 bytes little-endian header length N, N bytes of JSON header
({name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, padded with spaces to
a multiple of 8), then the raw little-endian tensor bytes. All shapes are known in advance, so the
header is written first and each tensor's bytes are appended as they arrive, in header order.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Dict, List, Sequence, Tuple

import torch

_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
          torch.uint8: "U8"}


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


class StreamingSafetensorsWriter:
    """`write(name, tensor)` must be called for every declared tensor, in declaration order;
    `close()` checks that and fsyncs the file.

    entries: (name, shape, dtype) in the order the data will be written.
    """

    def __init__(self, path: str, entries: Sequence[Tuple[str, Tuple[int, ...], torch.dtype]],
                 metadata: Dict[str, str] = None):
        header: Dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        self._expected: List[Tuple[str, Tuple[int, ...], torch.dtype]] = []
        offset = 0
        for name, shape, dtype in entries:
            size = nbytes(shape, dtype)
            header[name] = {"dtype": _NAMES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            self._expected.append((name, tuple(shape), dtype))
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = path
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want = self._expected[self._next] if self._next < len(self._expected) else None
        if want is None or want[0] != name:
            raise AssertionError(f"{self.path}: wrote {name!r}, expected {want and want[0]!r}")
        if tuple(tensor.shape) != want[1] or tensor.dtype != want[2]:
            raise AssertionError(f"{self.path}: {name} is {tensor.dtype} {list(tensor.shape)}, "
                                 f"declared {want[2]} {list(want[1])}")
        data = tensor.detach().contiguous().cpu()
        self._f.write(data.view(torch.uint8).reshape(-1).numpy().data if data.numel() else b"")
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._expected):
            missing = [e[0] for e in self._expected[self._next:]]
            self._f.close()
            raise AssertionError(f"{self.path}: tensors never written: {missing[:5]}")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self._f.close()
