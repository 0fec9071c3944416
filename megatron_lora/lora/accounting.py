"""Measure what a layer costs beyond arithmetic: collective traffic and saved activations.

record_collectives(): wraps torch.distributed's collectives for the duration of a `with` block
    and records one CollectiveCall per call (op, shape, dtype, bytes of the full-size tensor:
    the all-reduced tensor, the gathered output, the reduce-scattered input).
record_saved_tensors(): counts the tensors autograd keeps for backward
    (torch.autograd.graph.saved_tensors_hooks), skipping parameters and counting a tensor saved
    twice once.

Used by the tests (nothing hidden-sized on the LoRA path, no gathered/up-cast copies kept) and by
benchmarks/lora_linear.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, List

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CollectiveCall:
    op: str
    shape: tuple
    dtype: torch.dtype
    nbytes: int

    @property
    def last_dim(self) -> int:
        return self.shape[-1] if self.shape else 1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# op name -> which argument holds the full-size tensor, and how to size it
_SIZERS = {
    "all_reduce": lambda a, k: (a[0] if a else k["tensor"]),
    "all_gather_into_tensor": lambda a, k: (a[0] if a else k["output_tensor"]),
    "reduce_scatter_tensor": lambda a, k: (a[1] if len(a) > 1 else k["input"]),
    "broadcast": lambda a, k: (a[0] if a else k["tensor"]),
    "all_to_all_single": lambda a, k: (a[1] if len(a) > 1 else k["input"]),
}


@contextlib.contextmanager
def record_collectives():
    """Yields a list that fills with CollectiveCall records while the block runs."""
    calls: List[CollectiveCall] = []
    originals = {}

    def wrap(name, fn):
        sizer = _SIZERS.get(name)

        def counted(*args, **kwargs):
            if name in ("all_gather", "reduce_scatter"):
                # list forms: (output_list, input) / (output, input_list)
                src = args[1] if len(args) > 1 else kwargs.get("tensor", kwargs.get("input_list"))
                if isinstance(src, (list, tuple)):
                    shape = (len(src),) + tuple(src[0].shape)
                    nbytes = sum(_nbytes(t) for t in src)
                    dtype = src[0].dtype
                else:
                    group = kwargs.get("group", args[2] if len(args) > 2 else None)
                    size = dist.get_world_size(group)
                    shape, dtype = (size,) + tuple(src.shape), src.dtype
                    nbytes = _nbytes(src) * size
            else:
                t = sizer(args, kwargs)
                shape, dtype, nbytes = tuple(t.shape), t.dtype, _nbytes(t)
            calls.append(CollectiveCall(name, shape, dtype, nbytes))
            return fn(*args, **kwargs)

        return counted

    names = list(_SIZERS) + ["all_gather", "reduce_scatter"]
    for name in names:
        if hasattr(dist, name):
            originals[name] = getattr(dist, name)
            setattr(dist, name, wrap(name, originals[name]))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@dataclass(frozen=True)
class SavedTensor:
    shape: tuple
    dtype: torch.dtype
    nbytes: int


@contextlib.contextmanager
def record_saved_tensors(exclude: Iterable[torch.Tensor] = ()):
    """Yields a list of SavedTensor for every distinct non-parameter tensor saved for backward."""
    saved: List[SavedTensor] = []
    skip = {t.data_ptr() for t in exclude}
    seen = set()

    def pack(t):
        ident = (t.data_ptr(), t.numel(), t.dtype)
        if not isinstance(t, torch.nn.Parameter) and t.data_ptr() not in skip and ident not in seen:
            seen.add(ident)
            saved.append(SavedTensor(tuple(t.shape), t.dtype, _nbytes(t)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


__all__ = ["CollectiveCall", "SavedTensor", "record_collectives", "record_saved_tensors"]
