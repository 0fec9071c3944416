"""One gloo transport device per process, shared by every gloo process group.

torch.distributed gives each gloo process group a transport device of its own
(`ProcessGroupGloo(store, rank, size, timeout)` creates a default device), and each gloo TCP device
runs an event-loop thread that wakes every 10 ms (`epoll_wait(..., 10)`) whether or not anything
is in flight. megatron-core builds about twenty groups for one layout (tensor, pipeline, data,
expert, embedding groups and their gloo twins), so a CPU rank ran twenty such threads: about 2000
wake-ups a second per rank doing nothing, which on a 2-core machine running eight ranks is kernel
time taken from the ranks that do work (measured: an idle 4-rank TP2xEP2 world spent 70 ms of
system CPU per rank every 5 s; with one shared device, 5 ms).

gloo's devices are made to serve many pairs (every pair of a group already shares its group's
device, told apart by the listener's sequence numbers), so groups can share one. `install()`
replaces the class torch.distributed constructs with a subclass that passes one per-process
device in the group's options; groups behave exactly as before (same class for `isinstance`,
same timeout, same worker threads). It is installed by `runtime.init_process_group` for the gloo
backend only: with NCCL, megatron's few gloo groups carry checkpoint metadata alone.
"""

from __future__ import annotations

import datetime
from typing import Optional

_DEVICE = None


def _shared_device():
    global _DEVICE
    if _DEVICE is None:
        from torch._C._distributed_c10d import ProcessGroupGloo

        _DEVICE = ProcessGroupGloo.create_default_device()
    return _DEVICE


def install() -> bool:
    """Make every gloo process group created from now on use this process's one device.
    Idempotent; returns whether the subclass is in place."""
    from torch.distributed import distributed_c10d as c10d

    real = getattr(c10d, "ProcessGroupGloo", None)
    if real is None:  # torch built without gloo
        return False
    if getattr(real, "_mlora_shared_device", False):
        return True

    class ProcessGroupGloo(real):
        _mlora_shared_device = True

        def __init__(self, store, rank, size, timeout: Optional[datetime.timedelta] = None):
            if isinstance(timeout, real._Options):  # the (store, rank, size, options) overload
                options = timeout
            else:
                options = real._Options()
                if timeout is not None:
                    options._timeout = timeout
            if not options._devices:
                options._devices = [_shared_device()]
            super().__init__(store, rank, size, options)

    ProcessGroupGloo.__module__ = real.__module__
    ProcessGroupGloo.__qualname__ = real.__qualname__
    c10d.ProcessGroupGloo = ProcessGroupGloo
    return True


def installed() -> bool:
    from torch.distributed import distributed_c10d as c10d

    return bool(getattr(getattr(c10d, "ProcessGroupGloo", None), "_mlora_shared_device", False))
