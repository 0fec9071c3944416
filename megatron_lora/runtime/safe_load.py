"""Checkpoint files are read as data, never as code: the one path every checkpoint read takes.

A torch_dist checkpoint holds files that torch and megatron-core would unpickle: `.metadata` (a
plain pickle of torch.distributed.checkpoint's `Metadata`) and `common.pt` (a torch.save archive;
older versions also wrote per-rank `rng/rank_*.pt`, which is never read). Here:

- `load_dcp_metadata(directory)` unpickles `.metadata` with `RestrictedUnpickler`: only the exact
  (module, name) pairs in `ALLOWED_GLOBALS` resolve (the checkpoint-metadata dataclasses, torch
  dtypes, torch.Size, ...), looked up in a table built at import, never by attribute lookups
  through a module (a protocol-4 name such as `os.system` inside an allowed module is refused like
  any other). The result must be a `Metadata`, and every data file it names (`relative_path`) must
  lie inside the checkpoint folder (`confined_path`). Every file read (`.metadata`, `common.pt`,
  `metadata.json`, ...) must itself resolve inside it too (`own_file`: no symlink out).
- `safe_torch_load(path)`: `torch.load(weights_only=True, map_location="cpu")`.
- `dist_load(sharded_state_dict, directory)`: megatron's `dist_checkpointing.load` with load
  strategies whose every read goes through the two functions above (the tensor chunks themselves
  are read by torch with weights_only=True already).

Anything else raises `CheckpointFileError` (a ValueError) naming the file; the only callables a
file can reach are the allowed ones (dataclasses, enums, torch.Size, paths, containers, torch's
layout-by-name lookup). Works with the megatron-core versions this package supports: optional
hooks are feature-detected.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import pickle
import re
import threading
from typing import Any, Dict, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint import metadata as _dcp_md
from torch.distributed.checkpoint import planner as _dcp_planner

from megatron_lora.runtime.folder_files import outside_folder

METADATA_NAME = ".metadata"
COMMON_NAME = "common.pt"


class CheckpointFileError(ValueError):
    """A checkpoint file that is missing, corrupt, or holds something other than plain data."""

    def __init__(self, path: str, problem: str):
        self.path, self.problem = path, problem
        super().__init__(f"{path}: {problem}")

    def __reduce__(self):  # torch DCP pickles a rank's exception to every rank
        return type(self), (self.path, self.problem)


def _allowed_globals() -> Dict[Tuple[str, str], Any]:
    """(module, name) -> object, for every global a legitimate `.metadata` pickle references.

    Found by recording the globals of the metadata of our conversions, of our training checkpoints
    and of checkpoints megatron-core's dist_checkpointing.save wrote; names missing from this torch
    are skipped.
    """
    table = {}
    wanted = {
        _dcp_md: ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                  "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                  "_MEM_FORMAT_ENCODING"),
        _dcp_planner: ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                       "LoadItemType"),
        _dcp_fs: ("_StorageInfo",),
    }
    for module, names in wanted.items():
        for name in names:
            if hasattr(module, name):
                table[(module.__name__, name)] = getattr(module, name)
    table[("torch", "Size")] = torch.Size
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            table[("torch", name)] = value
    # torch pickles a layout as _get_layout("torch.strided"): a lookup in a table of layouts.
    if hasattr(torch.serialization, "_get_layout"):
        table[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    import collections
    import pathlib

    table[("pathlib", "PosixPath")] = pathlib.PosixPath  # StorageMeta.checkpoint_id
    table[("pathlib", "PurePosixPath")] = pathlib.PurePosixPath
    table[("collections", "OrderedDict")] = collections.OrderedDict
    for name in ("set", "frozenset"):
        table[("builtins", name)] = getattr(__import__("builtins"), name)
    return table


ALLOWED_GLOBALS: Dict[Tuple[str, str], Any] = _allowed_globals()


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the exact (module, name) pairs of ALLOWED_GLOBALS."""

    def find_class(self, module, name):
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except (KeyError, TypeError):
            raise pickle.UnpicklingError(
                f"refusing {module}.{name}: not a checkpoint-metadata class") from None

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refusing a persistent id: not plain checkpoint metadata")


def confined_path(directory: str, name: Any, source: str, field: str) -> str:
    """os.path.join(directory, name) if `name` is a relative path that stays inside `directory`
    (after symlinks are resolved; runtime/folder_files.py); CheckpointFileError naming `source`
    and `field` otherwise."""
    if not isinstance(name, str) or not name:
        raise CheckpointFileError(source, f"{field} must be a non-empty file name, got {name!r}")
    parts = re.split(r"[\\/]", name)
    if os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts or ":" in parts[0]:
        raise CheckpointFileError(source, f"{field} {name!r} points outside {directory}: only "
                                          f"file names inside the folder are accepted")
    path = os.path.join(directory, name)
    real = outside_folder(directory, path)  # a hub-cache snapshot may link to its own blobs
    if real is not None:
        raise CheckpointFileError(source, f"{field} {name!r} resolves to {real}, outside "
                                          f"{os.path.realpath(directory)} (a symlink out of the "
                                          f"folder?)")
    return path


def own_file(directory: str, path: str) -> str:
    """`path`, a file of the checkpoint folder `directory`, if it resolves inside it;
    CheckpointFileError naming the file, where it resolves and the folder otherwise."""
    real = outside_folder(str(directory), path)
    if real is not None:
        raise CheckpointFileError(path, f"resolves to {real}, outside the checkpoint folder "
                                        f"{os.path.realpath(str(directory))} (a symlink out of "
                                        f"it); only files inside the folder are read")
    return path


def _short(exc: BaseException) -> str:
    text = str(exc)
    m = re.search(r"(Unsupported global: [^\n]*|Unsupported operand [^\n]*|"
                  r"Trying to [^\n]*|Unsupported class [^\n]*)", text)
    line = m.group(1) if m else (text.strip().splitlines() or [type(exc).__name__])[0]
    return line[:300]


def load_dcp_metadata(directory: str, rank: Optional[int] = None):
    """The `Metadata` of a torch_dist checkpoint (or of rank-local `__{rank}.metadata`), read with
    RestrictedUnpickler and checked: right type, data files confined to `directory`."""
    name = METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"
    path = own_file(directory, os.path.join(str(directory), name))
    try:
        with open(path, "rb") as f:
            md = RestrictedUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointFileError(path, "missing: not a complete torch_dist checkpoint") from None
    except Exception as exc:  # anything an allowed constructor may raise on odd arguments
        raise CheckpointFileError(path, f"not plain checkpoint metadata ({_short(exc)}); "
                                        f"nothing in it was run") from None
    if not isinstance(md, _dcp_md.Metadata):
        raise CheckpointFileError(path, f"holds a {type(md).__name__}, not checkpoint Metadata")
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data or {}, dict):
        raise CheckpointFileError(path, "state_dict_metadata / storage_data are not dicts")
    for index, info in (md.storage_data or {}).items():
        if not isinstance(info, _dcp_fs._StorageInfo):
            raise CheckpointFileError(path, f"storage entry for {getattr(index, 'fqn', index)!r} "
                                            f"is a {type(info).__name__}, not _StorageInfo")
        confined_path(str(directory), info.relative_path, path,
                      f"relative_path of {getattr(index, 'fqn', index)!r}")
    return md


def safe_torch_load(path_or_file, name: Optional[str] = None):
    """torch.load(weights_only=True, map_location='cpu'); CheckpointFileError naming the file
    (`name`, or the path) for anything that is not tensors and plain containers."""
    name = name or str(path_or_file)
    try:
        return torch.load(path_or_file, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointFileError(name, "missing") from None
    except Exception as exc:
        raise CheckpointFileError(name, f"not a plain-data torch file ({_short(exc)}); nothing "
                                        f"in it was run") from None


COMMON_OBJECT = "common_state/shard_0_1"  # megatron-core 0.19+: ShardedObject("common_state")


def load_common_state(directory: str, metadata=None) -> Dict:
    """The common (non-tensor) state of a megatron-core checkpoint, plain data, read safely.

    Either form (see runtime/versions.py): `common.pt` (written by megatron-core <= 0.18), or the
    `common_state` object stored inside the torch_dist data files (0.19+), read from its byte
    range with weights_only=True. So a checkpoint of either release reads under either release.
    """
    legacy = os.path.join(str(directory), COMMON_NAME)
    if os.path.lexists(legacy):
        common, where = safe_torch_load(own_file(directory, legacy)), legacy
    else:
        md = metadata if metadata is not None else load_dcp_metadata(directory)
        info = next((s for i, s in (md.storage_data or {}).items()
                     if getattr(i, "fqn", None) == COMMON_OBJECT), None)
        if info is None:
            raise CheckpointFileError(legacy, "missing, and the checkpoint stores no "
                                              f"{COMMON_OBJECT!r} object either")
        where = confined_path(str(directory), info.relative_path,
                              os.path.join(str(directory), METADATA_NAME), COMMON_OBJECT)
        with open(where, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        if len(blob) != info.length:
            raise CheckpointFileError(where, f"truncated: {COMMON_OBJECT} needs {info.length} "
                                             f"bytes at {info.offset}")
        common = safe_torch_load(io.BytesIO(blob), f"{where} ({COMMON_OBJECT})")
        # megatron stores the object's data as a one-element list (its load takes [0]).
        if isinstance(common, (list, tuple)) and len(common) == 1:
            common = common[0]
    if not isinstance(common, dict):
        raise CheckpointFileError(where, f"holds a {type(common).__name__}, expected a dict")
    return common


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader whose metadata is the already-validated `metadata` (or is read by
    load_dcp_metadata). Tensor chunks are read by the parent with weights_only=True."""

    def __init__(self, path, metadata=None, *args, **kwargs):
        super().__init__(path)
        self._safe_metadata = metadata

    def _slice_file(self, file, sinfo):
        self._reading = sinfo.relative_path  # which data file a failure is about
        return super()._slice_file(file, sinfo)

    def read_data(self, *args, **kwargs):
        self._reading = None
        try:
            return super().read_data(*args, **kwargs)
        except Exception as exc:
            where = os.path.join(str(self.path), self._reading) if self._reading else str(self.path)
            if isinstance(exc, pickle.UnpicklingError):
                raise CheckpointFileError(where, f"a stored tensor is not plain data "
                                                 f"({_short(exc)}); nothing in it was run") from None
            raise CheckpointFileError(where, f"cannot read a stored tensor ({_short(exc)})") from None

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        if rank is not None:
            md = load_dcp_metadata(str(self.path), rank)
        else:
            if self._safe_metadata is None:
                self._safe_metadata = load_dcp_metadata(str(self.path))
            md = self._safe_metadata
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = _dcp_md.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


_READER_LOCK = threading.Lock()


@contextlib.contextmanager
def _safe_readers(metadata):
    """While a megatron load strategy runs, its module's reader factory hands out
    SafeFileSystemReader (megatron-core has no argument for this). Restored on exit."""
    from megatron.core.dist_checkpointing.strategies import torch as mtorch

    original = getattr(mtorch, "_get_filesystem_reader", None)
    if original is None:  # no factory to point at us: the caller validated the metadata already
        yield
        return

    def factory(checkpoint_dir, *args, **kwargs):
        return SafeFileSystemReader(checkpoint_dir, metadata)

    with _READER_LOCK:
        mtorch._get_filesystem_reader = factory
        try:
            yield
        finally:
            mtorch._get_filesystem_reader = original


def _strategies():
    from megatron.core.dist_checkpointing.strategies import torch as mtorch

    class SafeTorchDistLoadShardedStrategy(mtorch.TorchDistLoadShardedStrategy):
        """megatron's torch_dist load strategy, reading `.metadata` through load_dcp_metadata."""

        def load(self, sharded_state_dict, checkpoint_dir, *args, **kwargs):
            with _safe_readers(load_dcp_metadata(str(checkpoint_dir))):
                return super().load(sharded_state_dict, checkpoint_dir, *args, **kwargs)

        def load_tensors_metadata(self, checkpoint_dir, metadata=None, *args, **kwargs):
            if metadata is None:
                metadata = load_dcp_metadata(str(checkpoint_dir))
            return super().load_tensors_metadata(checkpoint_dir, metadata, *args, **kwargs)

        def load_sharded_metadata(self, checkpoint_dir, *args, **kwargs):
            with _safe_readers(load_dcp_metadata(str(checkpoint_dir))):
                return super().load_sharded_metadata(checkpoint_dir, *args, **kwargs)

    out = {"sharded_strategy": SafeTorchDistLoadShardedStrategy()}
    try:
        from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    except ImportError:  # newer megatron-core: no separate common strategy
        return out

    class SafeTorchCommonLoadStrategy(TorchCommonLoadStrategy):
        """megatron's common-state load strategy, reading every file with safe_torch_load."""

        def load_common(self, checkpoint_dir):
            return load_common_state(str(checkpoint_dir))

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

            def one(sh_obj):
                path = confined_path(str(checkpoint_dir), f"{sh_obj.unique_key}.pt",
                                     str(checkpoint_dir), "sharded object")
                return safe_torch_load(path)

            return dict_list_map_inplace(one, sharded_objects_state_dict)

    out["common_strategy"] = SafeTorchCommonLoadStrategy()
    return out


def check_checkpoint(directory: str) -> Tuple[Any, Optional[Dict]]:
    """(Metadata, common state or None where there is no common.pt) of a torch_dist checkpoint,
    both read safely. Local (no collective): every rank that calls it on the same folder fails
    alike, before any collective."""
    own_file(directory, os.path.join(str(directory), "metadata.json"))  # megatron reads it
    md = load_dcp_metadata(directory)
    has_common = os.path.lexists(os.path.join(str(directory), COMMON_NAME)) or any(
        getattr(i, "fqn", None) == COMMON_OBJECT for i in (md.storage_data or {}))
    return md, (load_common_state(directory, md) if has_common else None)


def dist_load(sharded_state_dict, directory: str, **kwargs):
    """megatron-core `dist_checkpointing.load` with every checkpoint file read through this
    module. The metadata and common state are read and checked first, locally on every rank, so a
    bad file raises CheckpointFileError on all ranks before the first collective. Collective."""
    from megatron.core import dist_checkpointing

    check_checkpoint(directory)
    accepted = inspect.signature(dist_checkpointing.load).parameters
    for key, strategy in _strategies().items():
        if key in accepted:
            kwargs.setdefault(key, strategy)
    try:
        return dist_checkpointing.load(sharded_state_dict, directory, **kwargs)
    except _load_errors() as exc:
        raise _as_file_error(exc, str(directory)) from None


def _load_errors() -> tuple:
    """torch DCP's CheckpointException (raised on every rank alike: a chunk that is not a plain
    tensor, a missing data file) and megatron-core's CheckpointingException, where present."""
    found = []
    try:
        from torch.distributed.checkpoint.api import CheckpointException

        found.append(CheckpointException)
    except ImportError:
        pass
    try:
        from megatron.core.dist_checkpointing.core import CheckpointingException

        found.append(CheckpointingException)
    except ImportError:
        pass
    return tuple(found)


def _as_file_error(exc: Exception, directory: str) -> CheckpointFileError:
    failures = getattr(exc, "failures", None)  # {rank: (exception, traceback)}
    if isinstance(failures, dict) and failures:
        rank, wrapped = sorted(failures.items())[0]
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, CheckpointFileError):
            return inner
        return CheckpointFileError(directory, f"cannot be loaded (rank {rank}: {_short(inner)})")
    return CheckpointFileError(directory, f"cannot be loaded ({_short(exc)})")
