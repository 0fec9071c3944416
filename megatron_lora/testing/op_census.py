"""Kernel-bearing ops and trainable tensors per training step, counted under the device check.

A GPU step's launch overhead grows with the number of device ops it dispatches (each a kernel
launch, or a few) and with the number of trainable tensors (each its own optimizer, gradient-norm
and DDP-bucket work unless fused). Neither depends on the machine, so a CPU run can count them:

- `OpCensus` (a TorchDispatchMode, entered inside a `DeviceCheck`) counts, per command and
  training step of the check (`check.command`, `check.step`: forward, backward, the optimizer
  step and what the loop does until the next step's forward_backward), every aten op that
  launches a kernel on the rank's device: an op with a device tensor among its inputs, or a
  factory given the rank's device. Not counted: views (`OpOverload.is_view`: aliases of their
  input), ops that only allocate or change metadata (`NO_KERNEL`), host reads
  (`_local_scalar_dense`: a copy the check counts as a read), ops on host tensors only (CPU work
  on a GPU machine).
  Dispatch modes see autograd's backward too (built-in ops' backward, gradient hooks), which the
  check's function mode does not: the census marks the outputs of device ops as device memory
  itself, so gradients made in backward count as device tensors.
- the first training step of each command records its model's trainable tensors: in total and
  inside each MoE layer (megatron's MoELayer: router, experts, shared experts, adapters).

The figures are dispatcher ops, not CUDA kernels: a fused op may launch several kernels, and on
a GPU some ops (a copy to the host) launch none. They compare code paths (per-expert against
stacked adapters), not devices.
"""

from __future__ import annotations

import collections
import weakref
from typing import Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lora.testing.device_check import DeviceCheck, _is_rank_device, _storage, _tensors

_aten = torch.ops.aten
# Ops that allocate, alias or read metadata: no kernel on a GPU.
NO_KERNEL = frozenset({
    _aten.detach, _aten.lift_fresh, _aten.empty, _aten.empty_strided, _aten.new_empty,
    _aten.new_empty_strided, _aten.empty_like, _aten._local_scalar_dense, _aten.set_,
    _aten.resize_, _aten._unsafe_view, _aten.alias, _aten.sym_size, _aten.sym_stride,
    _aten.sym_numel, _aten.sym_storage_offset, _aten.is_same_size,
    _aten._has_compatible_shallow_copy_type, _aten.record_stream,
})


def launches_kernel(func) -> bool:
    """Whether aten op `func` (an OpOverload) computes or copies on its device."""
    return not func.is_view and func.overloadpacket not in NO_KERNEL


class OpCensus(TorchDispatchMode):
    """Enter inside `check` (after it); `ops` and `trainable` say what it counted."""

    def __init__(self, check: DeviceCheck):
        super().__init__()
        self.check = check
        self._device = weakref.WeakSet()  # storages device ops made (backward's included)
        self.ops: Dict[tuple, collections.Counter] = collections.defaultdict(collections.Counter)
        self.trainable: Dict[int, dict] = {}

    def _on_device(self, t: torch.Tensor) -> bool:
        s = _storage(t)
        return s is not None and (s in self._device or self.check.is_device(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        step = self.check.step - self.check._command_start
        if step == 0:  # building and loading: not a step
            return out
        inputs = _tensors(args, []) + _tensors(kwargs, [])
        if any(self._on_device(t) for t in inputs) or _is_rank_device(kwargs.get("device")):
            for t in _tensors(out, []):
                s = _storage(t)
                if s is not None:
                    self._device.add(s)
            if launches_kernel(func):
                self.ops[(self.check.command, step)][str(func.overloadpacket)] += 1
        return out

    def count_trainable(self, model_chunks) -> None:
        """Record the trainable tensors of `model_chunks` for the current command (once)."""
        if self.check.command in self.trainable:
            return
        from megatron.core.transformer.moe.moe_layer import MoELayer

        chunks = list(model_chunks)
        per_layer = [sum(1 for p in m.parameters() if p.requires_grad)
                     for chunk in chunks for m in chunk.modules() if isinstance(m, MoELayer)]
        total = sum(1 for chunk in chunks for p in chunk.parameters() if p.requires_grad)
        self.trainable[self.check.command] = {"total": total, "per_moe_layer": per_layer}

    def report(self) -> dict:
        """{"ops": [{command, step (1: the command's first training step), kernel_ops, top}],
        "trainable": [{command, total, per_moe_layer}]}; `top`: the step's ten most frequent
        ops."""
        ops: List[dict] = [{"command": c, "step": s, "kernel_ops": sum(n.values()),
                            "top": dict(n.most_common(10))}
                           for (c, s), n in sorted(self.ops.items())]
        return {"ops": ops, "trainable": [dict(command=c, **t)
                                          for c, t in sorted(self.trainable.items())]}

    def __enter__(self):
        """Also wrap training.loop.forward_backward (inside the check's count_steps) to record
        each command's trainable tensors at its first training step."""
        from megatron_lora.training import loop

        original = self._original = loop.forward_backward
        census = self

        def counted(model_chunks, *args, **kwargs):
            if not kwargs.get("forward_only"):
                census.count_trainable(model_chunks)
            return original(model_chunks, *args, **kwargs)

        loop.forward_backward = counted
        return super().__enter__()

    def __exit__(self, *exc):
        from megatron_lora.training import loop

        out = super().__exit__(*exc)
        loop.forward_backward = self._original
        return out
