"""Opening a user's data file only when it is a regular file.

A FIFO given as a data file blocks `open` until something writes to it, and a character device
such as /dev/zero reads without end; opening some devices even has effects of its own. So a data
file is looked at (os.stat, which follows symlinks) before it is opened, and refused unless it is
a regular file; the file opened is checked again (os.fstat), non-blocking, in case the path was
replaced in between.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO, Callable, Optional

from megatron_lora.jsonfile import os_reason

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a plain file")


def regular_file_problem(path: str) -> Optional[str]:
    """None when `path` is (or links to) a regular file; otherwise why it cannot be read, e.g.
    "No such file or directory" or "a FIFO (named pipe), not a regular file"."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return os_reason(exc)
    if stat.S_ISREG(mode):
        return None
    return f"{_kind(mode)}, not a regular file"


def open_regular(path: str, error: Callable[[str], Exception],
                 where: Optional[str] = None) -> BinaryIO:
    """`path` opened for binary reading if it is a regular file; otherwise `error("{where}:
    cannot read: {reason}")` (`where` defaults to the path)."""
    where = path if where is None else where
    problem = regular_file_problem(path)
    if problem is None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            problem = os_reason(exc)
        else:
            mode = os.fstat(fd).st_mode
            if stat.S_ISREG(mode):
                return os.fdopen(fd, "rb")
            os.close(fd)
            problem = f"{_kind(mode)}, not a regular file"
    raise error(f"{where}: cannot read: {problem}")


__all__ = ["open_regular", "regular_file_problem"]
