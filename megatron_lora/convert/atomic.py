"""Write an output directory (or file) so that it exists only when complete.

    with atomic_directory("/ckpt/out") as tmp:   # /ckpt/.out.partial-XXXX
        ...write files into tmp...
    # on success tmp is renamed to /ckpt/out; on any exception tmp is deleted

The final name never holds a partial result: an interrupted or failed conversion leaves at most a
`.NAME.partial-*` directory (removed on exceptions), never something that looks like a checkpoint.
While it is being written, the partial directory holds a marker file (`MARKER`: the writer's pid,
host and process start time; removed just before the rename). A process killed mid-write cannot
clean up, so `clean_stale_partials(path)` (run by the next write of the same output) removes the
`.NAME.partial-*` / `.NAME.old-*` directories that carry our marker and whose writer is no longer
running, and nothing else.

With overwrite, an existing output is swapped with the new one in one step (renameat2
RENAME_EXCHANGE where the filesystem has it) and then deleted, so the output name always holds a
complete result.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import socket
import sys
import tempfile
from typing import List, Optional

from megatron_lora.convert.errors import ConversionError

MARKER = ".megatron-lora-partial.json"
_FORMAT = "megatron_lora.partial_output"


def check_output_free(path: str, overwrite: bool = False) -> None:
    """Raise ConversionError if `path` exists (and is not to be overwritten)."""
    if os.path.lexists(path) and not overwrite:
        raise ConversionError(f"{path}: output already exists (pass --overwrite to replace it)")


def _start_time(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _write_marker(directory: str, output: str) -> None:
    me = {"format": _FORMAT, "pid": os.getpid(), "host": socket.gethostname(),
          "start_time": _start_time(os.getpid()), "output": os.path.basename(output)}
    with open(os.path.join(directory, MARKER), "w") as f:
        json.dump(me, f)


def _read_marker(directory: str) -> Optional[dict]:
    try:
        with open(os.path.join(directory, MARKER)) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != _FORMAT:
        return None
    if type(marker.get("pid")) is not int or not isinstance(marker.get("host"), str):
        return None
    return marker


def _writer_alive(marker: dict) -> bool:
    """False only when the writer is known to be gone: same host, and its pid is not running or
    is now another process (a different start time)."""
    if marker["host"] != socket.gethostname():
        return True  # another machine's process: we cannot tell, so it is kept
    pid = marker["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists (another user's process)
    started = marker.get("start_time")
    now = _start_time(pid)
    return started is None or now is None or started == now


def clean_stale_partials(path: str, log=None) -> List[str]:
    """Remove `.NAME.partial-*` / `.NAME.old-*` directories next to `path` that this module
    created (they hold our marker) for a writer that is no longer running; returns them.

    `.NAME.old-*` holds the previous output during a non-atomic overwrite; it is removed only
    when `path` exists again (the new output is in place), else it is kept and reported, since it
    may be the only copy of the old output."""
    if log is None:
        def log(msg):
            print(msg, file=sys.stderr, flush=True)
    path = os.path.abspath(path)
    parent, base = os.path.dirname(path), os.path.basename(path)
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    removed = []
    for name in names:
        old = name.startswith(f".{base}.old-")
        if not (name.startswith(f".{base}.partial-") or old):
            continue
        candidate = os.path.join(parent, name)
        if os.path.islink(candidate) or not os.path.isdir(candidate):
            continue
        marker = _read_marker(candidate)
        if marker is None or _writer_alive(marker):
            continue
        if old and not os.path.lexists(path):
            log(f"note: {candidate} holds the previous contents of {path} from an interrupted "
                f"--overwrite (in its subfolder 'x'); it was left in place")
            continue
        shutil.rmtree(candidate, ignore_errors=True)
        if not os.path.lexists(candidate):
            removed.append(candidate)
            log(f"removed stale partial output {candidate} from an interrupted run "
                f"(pid {marker['pid']})")
    return removed


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this filesystem cannot exchange
        return False
    raise OSError(err, os.strerror(err), a)


@contextlib.contextmanager
def atomic_directory(path: str, overwrite: bool = False):
    path = os.path.abspath(path)
    check_output_free(path, overwrite)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.partial-", dir=parent)
    old = None
    try:
        _write_marker(tmp, path)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result is a normal directory
        yield tmp
        os.remove(os.path.join(tmp, MARKER))
        _fsync_dir(tmp)
        if os.path.lexists(path):
            if os.path.isdir(path) and not os.path.islink(path) and _exchange(tmp, path):
                # tmp now holds the previous output: mark it ours before deleting it, so that an
                # interruption here leaves something the next run may clean.
                with contextlib.suppress(OSError):
                    _write_marker(tmp, path)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                old = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.old-", dir=parent)
                _write_marker(old, path)
                os.rename(path, os.path.join(old, "x"))
                os.rename(tmp, path)
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not os.path.lexists(os.path.join(old, "x")):
            shutil.rmtree(old, ignore_errors=True)
        raise


@contextlib.contextmanager
def atomic_file(path: str):
    """Yield a temporary name next to `path`; on success it replaces `path` (os.replace), on any
    exception it is removed. The caller checks the output first (convert.outputs)."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.partial-{os.getpid()}-",
                               dir=os.path.dirname(path))
    os.close(fd)
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        # mkstemp (and e.g. safetensors) make the file private; the result is a normal file
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
