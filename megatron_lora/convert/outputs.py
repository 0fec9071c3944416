"""Check an output path before any work: it must not touch an input, and it must be writable.

    path = check_output(args.save, overwrite=args.overwrite, inputs={"--hf-dir": args.hf_dir})

Raises OutputError (a ConversionError: the CLIs exit 2) whose message names the flag and says
what to do, for:
  - an output that is the same as, inside, or contains an input (compared after resolving
    symlinks, and by device/inode so bind mounts and hard-linked folders count too): with
    --overwrite it would delete the input, without it the output would be mixed into an input;
  - a folder output that is an existing file, a file output that is an existing folder;
  - an existing output without --overwrite (folders with `exists_ok`, e.g. a training run folder
    that is resumed, are fine);
  - a nearest existing parent that is a file, or in which nothing can be created (a probe file is
    created and removed: permission bits, read-only mounts, immutable folders and root all answer
    truthfully that way);
  - with --overwrite, an existing folder in which nothing can be created (it could not be moved
    aside and deleted either).
Missing parent folders are fine (they are created when the output is written). The checks read
only the file system, so under torchrun every rank reaches the same verdict with no collective.
"""

from __future__ import annotations

import os
import tempfile
from typing import Dict, Iterable, List, Optional, Tuple

from megatron_lora.convert.errors import ConversionError


class OutputError(ConversionError):
    """An output path that cannot or must not be written; the message names the flag."""


def _ancestors(path: str) -> List[os.stat_result]:
    """stat() of the existing path itself (if it exists) and of each of its parents."""
    out = []
    p = os.path.realpath(path)
    while True:
        try:
            out.append(os.stat(p))
        except OSError:
            pass
        up = os.path.dirname(p)
        if up == p:
            return out
        p = up


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _under(child: str, parent: str) -> bool:
    return child.startswith(parent.rstrip(os.sep) + os.sep)


def overlap(output: str, inp: str) -> Optional[str]:
    """'is' / 'is inside' / 'contains' when `output` and the existing `inp` overlap, else None."""
    o, i = os.path.realpath(output), os.path.realpath(inp)
    try:
        i_stat = os.stat(inp)
    except OSError:
        return None
    try:
        o_stat = os.stat(output)
    except OSError:
        o_stat = None
    if o == i or (o_stat is not None and _same(o_stat, i_stat)):
        return "is"
    if _under(o, i) or any(_same(s, i_stat) for s in _ancestors(os.path.dirname(o))):
        return "is inside"
    if _under(i, o) or (o_stat is not None and
                        any(_same(s, o_stat) for s in _ancestors(os.path.dirname(i)))):
        return "contains"
    return None


def probe_writable(directory: str) -> Optional[str]:
    """None if a file can be created (and removed) in `directory`, else the reason."""
    try:
        fd, name = tempfile.mkstemp(prefix=".megatron-lora-probe-", dir=directory)
    except OSError as exc:
        return exc.strerror or str(exc)
    os.close(fd)
    try:
        os.remove(name)
    except OSError as exc:
        return f"a file created there cannot be removed ({exc.strerror or exc})"
    return None


def _nearest_existing(path: str) -> str:
    p = os.path.dirname(path)
    while not os.path.lexists(p):
        up = os.path.dirname(p)
        if up == p:
            break
        p = up
    return p


def check_output(path: str, *, kind: str = "dir", overwrite: bool = False,
                 inputs: Optional[Dict[str, Optional[str]]] = None, flag: str = "--save",
                 exists_ok: bool = False, overwrite_flag: str = "--overwrite") -> str:
    """Refuse (OutputError) an output that would destroy an input or fail to be written; see the
    module docstring. kind: 'dir' or 'file'. inputs: {flag: path} (None / missing paths are
    ignored). Returns the absolute path."""
    if kind not in ("dir", "file"):
        raise ValueError(f"kind must be 'dir' or 'file', got {kind!r}")
    if not path:
        raise OutputError(f"{flag}: empty output path")
    what = "folder" if kind == "dir" else "file"
    full = os.path.abspath(path)
    for in_flag, in_path in _inputs(inputs):
        rel = overlap(full, in_path)
        if rel is not None:
            raise OutputError(
                f"{flag} {path} {rel} the input {in_flag} {in_path}"
                f"{' (through a symlink or mount)' if _hidden(full, in_path) else ''}; writing "
                f"there would {'replace or delete' if rel != 'contains' else 'mix the output into'}"
                f" the input. Choose an output {what} outside every input.")
    if os.path.lexists(full):
        is_dir = os.path.isdir(full)
        if kind == "dir" and not is_dir:
            raise OutputError(f"{flag} {path} is an existing file, not a folder; remove it or "
                              f"choose another {flag}")
        if kind == "file" and is_dir:
            raise OutputError(f"{flag} {path} is an existing folder; give a file name (e.g. "
                              f"{os.path.join(path, 'logits.safetensors')})")
        if not (exists_ok or overwrite):
            raise OutputError(f"{flag} {path} already exists; pass {overwrite_flag} to replace "
                              f"it or choose another {flag}")
        if kind == "dir":
            reason = probe_writable(full)
            if reason:
                fix = "fix its permissions" if exists_ok else "it could not be replaced; fix that"
                raise OutputError(f"{flag} {path}: cannot write in this folder ({reason}); "
                                  f"{fix} or choose another {flag}")
        elif not os.access(full, os.W_OK):
            raise OutputError(f"{flag} {path}: the existing file cannot be replaced (not "
                              f"writable); fix its permissions or choose another {flag}")
    parent = _nearest_existing(full)
    if not os.path.isdir(parent):
        raise OutputError(f"{flag} {path}: {parent} is a file, so no {what} can be created "
                          f"below it; choose another {flag}")
    reason = probe_writable(parent)
    if reason:
        raise OutputError(f"{flag} {path}: cannot create anything in {parent} ({reason}); "
                          f"choose a writable location for {flag}")
    return full


def _inputs(inputs) -> Iterable[Tuple[str, str]]:
    for in_flag, in_path in (inputs or {}).items():
        if in_path and os.path.lexists(in_path):
            yield in_flag, in_path


def _hidden(output: str, inp: str) -> bool:
    """Whether the overlap is not visible in the path strings themselves."""
    o, i = os.path.abspath(output), os.path.abspath(inp)
    return not (o == i or _under(o, i) or _under(i, o))


def prepare_output_dir(path: str, *, overwrite: bool = False,
                       inputs: Optional[Dict[str, Optional[str]]] = None,
                       flag: str = "--save") -> str:
    """check_output for a folder written by atomic_directory, then remove the stale partial
    folders an interrupted earlier run left next to it (saying so on stderr)."""
    from megatron_lora.convert.atomic import clean_stale_partials

    full = check_output(path, kind="dir", overwrite=overwrite, inputs=inputs, flag=flag)
    clean_stale_partials(full)
    return full
