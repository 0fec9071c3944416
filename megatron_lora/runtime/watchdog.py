"""Stop a torchrun rank when its launcher dies.

torch elastic starts each rank in a new session (`start_new_session=True`), so a `kill -9` of the
torchrun process reaches none of them: orphaned ranks would go on training and saving
checkpoints. `watch_launcher()` makes this process die with its launcher, without writing
anything more:

  - Linux `prctl(PR_SET_PDEATHSIG, SIGKILL)`: the kernel kills this process the moment its parent
    exits (the elastic agent starts ranks from its main thread, so "the thread that forked us
    exited" is "the launcher exited"). SIGKILL runs no handler and writes nothing; a checkpoint
    being saved at that moment stays an `iter_*.tmp` folder that is never loaded, and the tracker
    keeps naming the previous complete one.
  - The race where the launcher died before prctl: the parent recorded at install time is
    compared with os.getppid() right after prctl, and a parent of pid 1 means it is already gone.
  - A daemon thread polls os.getppid() (every `poll_s`) as a second line where prctl is missing.

It is installed only for ranks of torch elastic (TORCHELASTIC_RUN_ID in the environment), on
Linux, once per process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Optional

_PR_SET_PDEATHSIG = 1
_WATCHED: Optional[int] = None  # the launcher's pid, once installed


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def _set_pdeathsig(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _launcher_gone(ppid: int) -> None:
    try:
        os.write(2, f"rank {os.environ.get('RANK', '?')} (pid {os.getpid()}): the launcher "
                    f"(pid {ppid}) is gone; stopping without writing anything\n".encode())
    except OSError:
        pass
    os._exit(1)  # no atexit handlers, no flushing of anything half-done


def _poll(ppid: int, poll_s: float) -> None:
    while True:
        time.sleep(poll_s)
        if os.getppid() != ppid:
            _launcher_gone(ppid)


def watch_launcher(poll_s: float = 0.5, force: bool = False) -> bool:
    """Make this rank exit when its launcher (the parent process) dies; see the module docstring.

    Returns whether the watchdog is active. Does nothing outside torch elastic unless `force`."""
    global _WATCHED
    if _WATCHED is not None:
        return True
    if not sys.platform.startswith("linux") or not (force or under_torchrun()):
        return False
    ppid = os.getppid()
    _set_pdeathsig(signal.SIGKILL)
    if ppid == 1 or os.getppid() != ppid:
        _launcher_gone(ppid)
    _WATCHED = ppid
    threading.Thread(target=_poll, args=(ppid, poll_s), name="launcher-watchdog",
                     daemon=True).start()
    return True
