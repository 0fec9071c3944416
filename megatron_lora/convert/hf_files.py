"""Read a Hugging Face safetensors checkpoint (one file, or shards + model.safetensors.index.json).

`HFCheckpoint(directory)` checks everything that can be checked without reading tensor data:
config.json, the index (a dict of tensor name -> shard file name, each shard inside the folder: no
`..`, absolute path or symlink out of it, save a hub-cache snapshot's links to its own blobs:
runtime/folder_files.py; the index itself too), that every shard the index names exists and has a
readable safetensors header, and that every tensor the index names is in its shard. Tensor data
is read on demand with
`read(name, index)`, through safetensors' `get_slice`, so a caller reads only the rows and columns
it needs. Each read opens the file and closes it again: the memory map never outlives one tensor,
so resident memory does not grow with the shard size.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from safetensors import safe_open

from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.finite import check_finite
from megatron_lora.runtime.folder_files import check_in_folder
from megatron_lora.runtime.safe_load import CheckpointFileError, confined_path

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "F64": torch.float64, "I64": torch.int64, "I32": torch.int32,
           "U8": torch.uint8,  # U8: MXFP4 blocks and E8M0 scales (convert/mxfp4.py)
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # convert/fp8.py


@dataclass(frozen=True)
class TensorInfo:
    file: str  # file name inside the checkpoint directory
    shape: Tuple[int, ...]
    dtype: torch.dtype


class HFCheckpoint:
    """The safetensors files of one HF checkpoint directory (config.json is read by the caller)."""

    def __init__(self, directory: str):
        self.directory = directory
        if not os.path.isdir(directory):
            raise ConversionError(f"{directory}: not a directory")
        weight_map = self._weight_map()
        self.tensors: Dict[str, TensorInfo] = {}
        for file in sorted(set(weight_map.values())):
            for name, info in self._read_header(file).items():
                if weight_map.get(name, file) == file:
                    self.tensors[name] = info
        for name, file in weight_map.items():
            if name not in self.tensors:
                raise ConversionError(
                    f"{self._path(file)}: tensor {name!r} is listed in {INDEX_NAME} for this file "
                    f"but the file does not contain it"
                )

    def _path(self, file: str) -> str:
        return os.path.join(self.directory, file)

    def _weight_map(self) -> Dict[str, str]:
        index = self._path(INDEX_NAME)
        if os.path.lexists(index):
            check_in_folder(self.directory, index, ConversionError)
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
                raise ConversionError(f"{index}: not a valid safetensors index ({exc!r})") from None
            if not isinstance(weight_map, dict) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
                raise ConversionError(
                    f"{index}: 'weight_map' must be an object mapping tensor names to shard file "
                    f"names (strings), got {type(weight_map).__name__}: {str(weight_map)[:200]}")
            for name, file in sorted(weight_map.items(), key=lambda kv: kv[1]):
                try:  # a shard must be a file inside the folder: no '..', absolute path, symlink out
                    confined_path(self.directory, file, index, f"weight_map entry {name!r}")
                except CheckpointFileError as exc:
                    raise ConversionError(str(exc)) from None
                if not os.path.isfile(self._path(file)):
                    raise ConversionError(
                        f"{index}: shard {file!r} (holding tensor {name!r}) is missing from "
                        f"{self.directory}"
                    )
            return dict(weight_map)
        if os.path.isfile(self._path(SINGLE_NAME)):
            try:
                confined_path(self.directory, SINGLE_NAME, self._path(SINGLE_NAME), "the file")
            except CheckpointFileError as exc:
                raise ConversionError(str(exc)) from None
            return {name: SINGLE_NAME for name in self._read_header(SINGLE_NAME)}
        raise ConversionError(
            f"{self.directory}: neither {INDEX_NAME} nor {SINGLE_NAME} found"
        )

    def _read_header(self, file: str) -> Dict[str, TensorInfo]:
        path = self._path(file)
        try:
            out = {}
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    dtype = _DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise ConversionError(
                            f"{path}: tensor {name!r} has unsupported dtype {sl.get_dtype()}"
                        )
                    out[name] = TensorInfo(file, tuple(sl.get_shape()), dtype)
            return out
        except ConversionError:
            raise
        except Exception as exc:  # safetensors raises its own error types for bad headers
            raise ConversionError(
                f"{path}: not a readable safetensors file (truncated or corrupt?): {exc}"
            ) from None

    def read(self, name: str, index: Optional[Tuple[slice, ...]] = None) -> torch.Tensor:
        """Tensor `name` (or the part `index` selects: a tuple of unit-step slices), as a fresh
        CPU tensor in the file's dtype. A NaN / inf element (floating point and float8 tensors)
        raises ConversionError naming the file, the tensor and the element."""
        info = self.tensors.get(name)
        if info is None:
            raise ConversionError(f"{self.directory}: no tensor named {name!r}")
        path = self._path(info.file)
        try:
            with safe_open(path, framework="pt") as f:
                if index is None:
                    tensor = f.get_tensor(name)
                else:
                    tensor = f.get_slice(name)[index]
        except Exception as exc:
            raise ConversionError(f"{path}: cannot read tensor {name!r}: {exc}") from None
        offset = [s.indices(n)[0] for s, n in zip(index or (), info.shape)]
        check_finite(tensor, name, path, offset)  # a NaN / inf weight is refused where read
        return tensor.clone() if tensor.untyped_storage().nbytes() != tensor.nbytes else tensor

    def total_bytes(self) -> int:
        return sum(_nbytes(i) for i in self.tensors.values())


def _nbytes(info: TensorInfo) -> int:
    n = info.dtype.itemsize
    for s in info.shape:
        n *= s
    return n
