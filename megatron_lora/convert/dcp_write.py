"""Write a megatron-core torch_dist checkpoint one chunk at a time, from lazily produced data.

A torch_dist checkpoint is a torch.distributed.checkpoint (DCP) directory (`.metadata` plus
`__0_*.distcp` data files) plus megatron's `metadata.json` (the backend names) and `common.pt`
(the non-sharded state, empty for model weights). DCP stores each global tensor as a list of
chunks (offsets, sizes) and reads any box of it back from whichever chunks overlap, which is what
lets megatron load it at any TP/PP/EP/ETP layout.

`write_torch_dist` plans every chunk up front from sizes alone, then DCP's file writer asks the
planner for each chunk's data (`resolve_data`) one at a time, writes it and drops it: at most one
chunk is in memory. Runs in one process, no process group needed.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from typing import Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from megatron_lora.convert.mapping import Chunk, ExtraState, McoreTensor
from megatron_lora.convert.regions import volume

MEGATRON_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                     "common_backend": "torch", "common_backend_version": 1}

ChunkData = Callable[[McoreTensor, Chunk], torch.Tensor]


class _LazyPlanner(SavePlanner):
    """A one-rank DCP save planner whose items come from a table, their data from a callback."""

    def __init__(self, items: List[WriteItem], resolve: Callable[[WriteItem], object]):
        self._items, self._resolve = items, resolve

    def set_up_planner(self, state_dict=None, storage_meta=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self._items)

    def create_global_plan(self, all_plans):
        plans, metadata = create_default_global_save_plan(all_plans)
        for fqn, md in metadata.state_dict_metadata.items():
            chunks = getattr(md, "chunks", None)
            if chunks is not None and sum(volume(c.sizes) for c in chunks) != volume(md.size):
                raise AssertionError(f"chunks of {fqn} do not tile its shape {list(md.size)}")
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        return self._resolve(write_item)


class _StreamingWriter(dcp.FileSystemWriter):
    """DCP's file writer with a data loop that keeps no reference to a chunk once written (the
    stock loop keeps the last chunk of every key alive until the file is done)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results: List[WriteResult] = []
        # Each chunk is one torch.save record. Its zip CRC32 costs about twice the write itself
        # (0.5 s per 262 MB here); torch's own option skips it, and torch.load (DCP, megatron,
        # our reader) reads such records as usual.
        crc = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            self._write_items(name, plan, planner, results)
        finally:
            torch.serialization.set_crc32_options(crc)
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _write_items(self, name, plan, planner, results) -> None:
        with open(os.path.join(self.path, name), "wb") as f:
            for item in plan.items:
                data = planner.resolve_data(item)
                offset = f.tell()
                if item.type == WriteItemType.BYTE_IO:
                    f.write(data.getbuffer())
                else:
                    torch.save(data, f)
                length = f.tell() - offset
                del data
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
            f.flush()
            os.fsync(f.fileno())


def _tensor_item(t: McoreTensor, c: Chunk, dtype: torch.dtype) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
    return WriteItem(
        index=MetadataIndex(t.key, torch.Size(c.offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(chunk=chunk, properties=TensorProperties(dtype=dtype),
                                    size=torch.Size(t.shape)),
    )


def _none_object() -> io.BytesIO:
    # megatron's torch_dist strategy stores a ShardedObject as torch.save([data]).
    buf = io.BytesIO()
    torch.save([None], buf)
    buf.seek(0)
    return buf


def write_torch_dist(
    directory: str,
    tensors: Sequence[McoreTensor],
    objects: Sequence[ExtraState],
    chunk_data: ChunkData,
    dtype: torch.dtype,
) -> None:
    """Write `tensors` (every chunk, from `chunk_data(tensor, chunk)`, a [chunk.sizes] tensor of
    `dtype`) and the None-valued `objects` as a torch_dist checkpoint into `directory` (which must
    be empty or new)."""
    items: List[WriteItem] = []
    by_index: Dict[Tuple[str, Tuple[int, ...]], Tuple[McoreTensor, Chunk]] = {}
    for t in tensors:
        for c in t.chunks:
            items.append(_tensor_item(t, c, t.dtype or dtype))
            by_index[(t.key, tuple(c.offsets))] = (t, c)
    items += [WriteItem(index=MetadataIndex(o.unique_key), type=WriteItemType.BYTE_IO)
              for o in objects]

    def resolve(item: WriteItem):
        if item.type == WriteItemType.BYTE_IO:
            return _none_object()
        t, c = by_index[(item.index.fqn, tuple(item.index.offset))]
        data = chunk_data(t, c)
        if tuple(data.shape) != tuple(c.sizes) or data.dtype != (t.dtype or dtype):
            raise AssertionError(
                f"{t.key} chunk at {list(c.offsets)}: got {data.dtype} {list(data.shape)}, "
                f"expected {t.dtype or dtype} {list(c.sizes)}"
            )
        return data

    os.makedirs(directory, exist_ok=True)
    writer = _StreamingWriter(directory, single_file_per_rank=True, sync_files=True,
                              overwrite=False)
    with warnings.catch_warnings():  # DCP warns that it saves from a single process: intended
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.save({}, storage_writer=writer, planner=_LazyPlanner(items, resolve), no_dist=True)
        except CheckpointException as exc:  # DCP wraps errors; re-raise the first original one
            failure = next(iter(exc.failures.values()), None)
            if failure is not None and isinstance(failure[0], Exception):
                raise failure[0] from None
            raise
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump(MEGATRON_METADATA, f)
    torch.save({}, os.path.join(directory, "common.pt"))
