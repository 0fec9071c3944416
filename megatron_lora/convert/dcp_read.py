"""Read boxes of global tensors from a megatron-core torch_dist checkpoint, one chunk at a time.

Works on any torch_dist checkpoint (ours, or one megatron saved at some layout): a box is
assembled from whichever stored chunks overlap it. Every file is read through
`runtime.safe_load`: the `.metadata` pickle with its allow-list of exact checkpoint-metadata classes
(the data files it names must lie inside the folder), `common.pt` and each chunk with
`torch.load(weights_only=True)`, a chunk straight from its byte range of the data file (no
intermediate copy of the bytes). One loaded chunk is cached, so the q/k/v rows of one layer's
fused QKV chunk cost one read.
"""

from __future__ import annotations

import io
import os
from typing import Dict, List, Sequence, Tuple

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.regions import assemble
from megatron_lora.jsonfile import read_json
from megatron_lora.runtime.safe_load import (
    CheckpointFileError,
    check_checkpoint,
    load_common_state,
    load_dcp_metadata,
    safe_torch_load,
)


class _FileRange(io.RawIOBase):
    """A read-only, seekable view of bytes [start, start+length) of an open file."""

    def __init__(self, f, start: int, length: int):
        self._f, self._start, self._len, self._pos = f, start, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, pos, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, min(self._len, base + pos))
        return self._pos

    def readinto(self, b):
        n = min(len(b), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(b)[:n])
        self._pos += got
        return got


class TorchDistCheckpoint:
    """A torch_dist checkpoint directory opened for reading."""

    def __init__(self, directory: str):
        self.directory = directory
        meta = read_json(os.path.join(directory, "metadata.json"), ConversionError,
                         what="not a megatron-core checkpoint")
        backend = meta.get("sharded_backend") if isinstance(meta, dict) else None
        if backend != "torch_dist":
            raise ConversionError(f"{directory}/metadata.json: sharded_backend={backend!r}, "
                                  f"only 'torch_dist' is supported")
        try:
            # restricted unpickler, data files confined; the common state in either form
            # (common.pt, or megatron-core 0.19's in-checkpoint object), None where neither
            md, self.common = check_checkpoint(directory)
        except CheckpointFileError as exc:
            raise ConversionError(str(exc)) from None
        self.tensors: Dict[str, dcp_metadata.TensorStorageMetadata] = {
            k: v for k, v in md.state_dict_metadata.items()
            if isinstance(v, dcp_metadata.TensorStorageMetadata)}
        self._storage = {(i.fqn, tuple(i.offset) if i.offset is not None else None): s
                         for i, s in md.storage_data.items()}
        self._cached: Tuple[tuple, torch.Tensor] = (None, None)

    def dtype(self, key: str) -> torch.dtype:
        return self._meta(key).properties.dtype

    def shape(self, key: str) -> Tuple[int, ...]:
        return tuple(self._meta(key).size)

    def _meta(self, key: str):
        if key not in self.tensors:
            raise ConversionError(f"{self.directory}: checkpoint has no tensor {key!r}")
        return self.tensors[key]

    def _load_chunk(self, key: str, offsets: Tuple[int, ...]) -> torch.Tensor:
        if self._cached[0] == (key, offsets):
            return self._cached[1]
        self._cached = (None, None)
        info = self._storage.get((key, offsets))
        if info is None or getattr(info, "transform_descriptors", None):
            raise ConversionError(f"{self.directory}: chunk {key} at {list(offsets)} is missing "
                                  f"or stored with an unsupported transform")
        path = os.path.join(self.directory, info.relative_path)  # confined when md was read
        try:
            with open(path, "rb") as f:
                tensor = safe_torch_load(_FileRange(f, info.offset, info.length), path)
        except (OSError, CheckpointFileError) as exc:
            raise ConversionError(f"{path}: cannot read chunk {key} at {list(offsets)}: {exc}") from None
        if not isinstance(tensor, torch.Tensor):
            raise ConversionError(f"{path}: chunk {key} at {list(offsets)} is a "
                                  f"{type(tensor).__name__}, not a tensor")
        self._cached = ((key, offsets), tensor)
        return tensor

    def read(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """The box (offsets, sizes) of global tensor `key`, in the checkpoint's dtype."""
        md = self._meta(key)
        if any(o < 0 or o + s > n for o, s, n in zip(offsets, sizes, md.size)):
            raise ConversionError(f"{self.directory}: box {list(offsets)}+{list(sizes)} is outside "
                                  f"{key} {list(md.size)}")
        chunks: List = []
        for c in md.chunks:
            c_off = tuple(c.offsets)
            chunks.append((c_off, tuple(c.sizes),
                           lambda index, k=key, o=c_off: self._load_chunk(k, o)[index]))
        try:
            return assemble(offsets, sizes, chunks, md.properties.dtype, key)
        except ValueError as exc:
            raise ConversionError(f"{self.directory}: {exc}") from None
