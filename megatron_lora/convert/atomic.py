"""Write an output directory so that it exists only when complete.

    with atomic_directory("/ckpt/out") as tmp:   # /ckpt/.out.partial-XXXX
        ...write files into tmp...
    # on success tmp is renamed to /ckpt/out; on any exception tmp is deleted

The final name never holds a partial result: an interrupted or failed conversion leaves at most a
`.NAME.partial-*` directory (removed on exceptions), never something that looks like a checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from megatron_lora.convert.errors import ConversionError


def check_output_free(path: str, overwrite: bool = False) -> None:
    """Raise ConversionError if `path` exists (and is not to be overwritten)."""
    if os.path.lexists(path) and not overwrite:
        raise ConversionError(f"{path}: output already exists (pass --overwrite to replace it)")


@contextlib.contextmanager
def atomic_directory(path: str, overwrite: bool = False):
    path = os.path.abspath(path)
    check_output_free(path, overwrite)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.partial-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result is a normal directory
    try:
        yield tmp
        _fsync_dir(tmp)
        if os.path.lexists(path):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=parent)
            os.rename(path, os.path.join(old, "x"))
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
