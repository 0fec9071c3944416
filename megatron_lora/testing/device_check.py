"""A stand-in for the rank's GPU on a CPU machine: what would fail on CUDA fails here too.

On a CPU rank every tensor lives in host memory, so a token batch that was never moved to the
rank's device, a parameter made after the model was moved, or a count made on the host for an
NCCL all-reduce computes exactly like a moved one: bugs that stop every command on its first GPU
step pass every CPU test. While a `DeviceCheck` is active:

- the rank's device is `cpu:0` (runtime.device() and megatron's torch.cuda.current_device(),
  runtime/cpu_compat.py), and every CUDA device argument means it; host memory is plain `cpu`.
  A storage is device memory when a factory made it with the rank's device, a move put it there
  (`.to(device)`, `.cuda()`) or an op with a device tensor among its inputs made it (the
  model's parameters, activations, what the step makes from them); every other storage (data
  made by the package on the host, files read by safetensors or torch.load) is host memory.
- `Tensor.device` answers `cpu:0` for device tensors and `cpu` for host ones (outside torch's own
  code), so placement checks and `device=x.device` factories behave as on a GPU.
- an op that mixes a host tensor of one or more dimensions with a device tensor raises
  DeviceCheckError, as CUDA does ("Expected all tensors to be on the same device"); copies
  (`to`, `copy_`) and indexing with host indices are allowed, as on CUDA; 0-dim host tensors
  are scalars to CUDA and pass.
- a collective given a host tensor on a device group (every group but those created with
  backend "gloo", megatron's host twins) raises, as NCCL does ("No backend type associated
  with device type cpu").
- a torch factory called from package code (megatron_lora/) without a `device` raises: the
  package says where each tensor it makes lives.
- every read of a device tensor's value on the host (`item`, `tolist`, `float`, `int`, `bool`,
  `numpy`, a copy to the host, each device element of a list given to `torch.tensor`: each a
  stream synchronisation on a GPU) is recorded with its call site and the training step it
  belongs to (`steps`, counted by calls of the training step).

The backward of custom autograd Functions (the package's LoRA, expert and collective Functions,
megatron's) runs under the check too, its incoming gradients taken as device tensors. Not seen:
the rest of what autograd's engine runs (built-in ops' backward, gradient hooks: megatron's DDP
hooks copy the gradients into device buffers), where torch applies no function mode.

`python -m megatron_lora.cli.device_check` runs commands under it (cli/device_check.py).
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys
import weakref
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

RANK = torch.device("cpu", 0)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH = os.path.dirname(torch.__file__)
_SKIP_FRAMES = (_TORCH, os.path.abspath(__file__),
                os.path.join(_PACKAGE, "runtime", "cpu_compat.py"))

_FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full,
              torch.arange, torch.range, torch.rand, torch.randn, torch.randint, torch.randperm,
              torch.eye, torch.linspace, torch.logspace, torch.empty_strided}
_ALWAYS_HOST = {torch.from_numpy, torch.frombuffer}
_LIKE = {torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
         torch.randn_like, torch.randint_like}
_NEW = {torch.Tensor.new_tensor, torch.Tensor.new_zeros, torch.Tensor.new_ones,
        torch.Tensor.new_empty, torch.Tensor.new_full}
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__,
          torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.numpy,
          torch.Tensor.__complex__, torch.Tensor.__repr__, torch.Tensor.__format__}
# What CUDA accepts across devices: copies, and host index tensors.
_CROSSING = {torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.__getitem__,
             torch.Tensor.__setitem__, torch.Tensor.index_put_,
             torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.pin_memory,
             torch._has_compatible_shallow_copy_type}
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                "_all_gather_base", "reduce_scatter_tensor", "_reduce_scatter_base",
                "reduce_scatter", "all_to_all_single", "all_to_all", "reduce", "send", "recv",
                "gather", "scatter", "batch_isend_irecv")
# (isend / irecv stay as they are: P2POp accepts those very functions only; batch_isend_irecv
# is checked through its ops' tensors.)


def _is_descriptor(func, descriptor, method: str) -> bool:
    """Whether `func` is `descriptor.<method>` (each lookup of it makes a new method-wrapper)."""
    return getattr(func, "__self__", None) is descriptor and func.__name__ == method


class DeviceCheckError(RuntimeError):
    """What a GPU would have refused."""


@dataclasses.dataclass(frozen=True)
class HostRead:
    site: str  # "path:line in function" of the first frame outside torch
    what: str  # the Tensor method
    step: int  # training steps begun before it (0: before the first)
    command: int  # index of the command (the driver's --then list)
    setup: bool  # before the command's first training step (building, loading)

    @property
    def in_package(self) -> bool:
        return self.site.startswith(_PACKAGE)


def _caller(depth: int = 2) -> str:
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_FRAMES):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


# Frames of the function modes between an access and this one (torch's device context).
_MODE_FRAMES = (os.path.join(_TORCH, "utils", "_device.py"), os.path.join(_TORCH, "overrides.py"),
                os.path.abspath(__file__), os.path.join(_PACKAGE, "runtime", "cpu_compat.py"))


def _accessor() -> str:
    """The file of the code that touched the tensor, the modes' frames skipped."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_MODE_FRAMES):
        frame = frame.f_back
    return "" if frame is None else frame.f_code.co_filename


def _tensors(obj, out: list, depth: int = 0, lists: int = 2) -> list:
    """The tensors in `obj`, looking into `lists` levels of lists and tuples, one of dicts."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)) and depth < lists:
        for item in obj:
            _tensors(item, out, depth + 1, lists)
    elif isinstance(obj, dict) and depth < 1:
        for item in obj.values():
            _tensors(item, out, depth + 1)
    return out


def _storage(t: torch.Tensor):
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        return None  # a subclass with ops of its own (torch's ShardedTensor): not looked into
    if t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def _is_rank_device(device) -> Optional[bool]:
    """True: the rank's device; False: host memory; None: neither (meta) or not given."""
    if device is None:
        return None
    if isinstance(device, int):
        return True  # a CUDA ordinal
    device = torch.device(device)
    if device.type == "cuda":
        return True
    if device.type == "cpu":
        return device.index is not None
    return None


class DeviceCheck(TorchFunctionMode):
    """Enter to check; `errors` and `reads` say what it saw (module docstring)."""

    def __init__(self):
        super().__init__()
        self._device = weakref.WeakSet()  # storages in the rank's device memory
        self._host_groups = weakref.WeakSet()
        self.errors: List[str] = []
        self.reads: List[HostRead] = []
        self.step = 0
        self.command = 0
        self._command_start = 0
        self._patched: Dict[tuple, object] = {}
        self._previous_rank = None

    # ---- memory kinds ----------------------------------------------------------------------
    def is_device(self, t: torch.Tensor) -> bool:
        s = _storage(t)
        return s is not None and s in self._device

    def is_host(self, t: torch.Tensor) -> bool:
        return _storage(t) is not None and not self.is_device(t)

    def _mark_device(self, result) -> None:
        for t in _tensors(result, []):
            s = _storage(t)
            if s is not None:
                self._device.add(s)

    def start_command(self, index: int) -> None:
        self.command, self._command_start = index, self.step

    def _read(self, func) -> HostRead:
        return HostRead(_caller(3), func.__name__, self.step, self.command,
                        self.step == self._command_start)

    def _fail(self, message: str) -> None:
        text = f"{message} (at {_caller(3)})"
        self.errors.append(text)
        raise DeviceCheckError(text)

    # ---- the mode --------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_descriptor(func, torch.Tensor.device, "__get__"):
            t = args[0]
            real = func(*args, **kwargs)
            if real.type != "cpu" or _accessor().startswith(_TORCH):
                return real  # torch's own code (distributed checkpoints) sees plain "cpu"
            return RANK if self.is_device(t) else torch.device("cpu")
        if func in _READS:
            if self.is_device(args[0]):
                self.reads.append(self._read(func))
            return func(*args, **kwargs)
        if func in _FACTORIES or func in _ALWAYS_HOST:
            return self._factory(func, args, kwargs)
        if func in _LIKE or func in _NEW:
            where = _is_rank_device(kwargs.get("device"))
            result = func(*args, **kwargs)
            if where or (where is None and self.is_device(args[0])):
                self._mark_device(result)
            return result
        if func in (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda,
                    torch.Tensor.pin_memory):
            return self._move(func, args, kwargs)
        inputs = _tensors(args, []) + _tensors(kwargs, [])
        device = [t for t in inputs if self.is_device(t)]
        if device and func not in _CROSSING and not _is_descriptor(
                func, torch.Tensor.data, "__set__"):
            host = [t for t in inputs if self.is_host(t)]
            wide = [t for t in host if t.dim() > 0]
            inplace = (getattr(func, "__name__", "").endswith("_") and inputs
                       and self.is_host(inputs[0]))
            if wide or inplace:
                self._fail(f"{getattr(func, '__name__', func)} mixes host tensors "
                           f"{[tuple(t.shape) for t in host]} with device tensors "
                           f"{[tuple(t.shape) for t in device][:4]}: on a GPU, 'Expected all "
                           f"tensors to be on the same device'")
        result = func(*args, **kwargs)
        if device:
            self._mark_device(result)
        return result

    def _factory(self, func, args, kwargs):
        if func in (torch.tensor, torch.as_tensor) and args and isinstance(args[0], (list, tuple)):
            # A list of device scalars (megatron's grad-norm fallback without apex:
            # torch.tensor([torch.norm(g) for g in grads])) is read element by element, one
            # synchronisation each on a GPU.
            self.reads += [self._read(func) for t in _tensors(args[0], [], lists=64)
                           if self.is_device(t)]
        if func not in _ALWAYS_HOST and "device" not in kwargs:
            site = _caller()
            if site.startswith(_PACKAGE) and not site.startswith(os.path.abspath(__file__)):
                self._fail(f"torch.{func.__name__} without a device in package code: say "
                           f"device=runtime.device() for the rank's device, 'cpu' for host memory")
        result = func(*args, **kwargs)
        if func not in _ALWAYS_HOST and _is_rank_device(kwargs.get("device")):
            self._mark_device(result)
        return result

    def _move(self, func, args, kwargs):
        source = args[0]
        if func is torch.Tensor.cuda:
            to_rank = True
        elif func in (torch.Tensor.cpu, torch.Tensor.pin_memory):
            to_rank = False
        elif len(args) > 1 and isinstance(args[1], torch.Tensor):
            to_rank = self.is_device(args[1])
        else:
            given = {k: v for k, v in kwargs.items() if k != "copy"}  # _parse_to refuses it
            target = torch._C._nn._parse_to(*args[1:], **given)[0]
            to_rank = _is_rank_device(target)
            if to_rank is None:  # a dtype change: same memory kind
                result = func(*args, **kwargs)
                if self.is_device(source):
                    self._mark_device(result)
                return result
        on_device = self.is_device(source)
        if not to_rank and on_device:
            self.reads.append(self._read(func))
        result = func(*args, **kwargs)
        if on_device != to_rank and _storage(result) is _storage(source):
            result = result.clone()  # a real move copies; on CPU torch hands back the source
        if to_rank:
            self._mark_device(result)
        return result

    # ---- collectives -----------------------------------------------------------------------
    def _wrap_collective(self, name, original):
        check = self

        def collective(*args, **kwargs):
            if not check._active():  # inside autograd's backward: its tensors are not tracked
                return original(*args, **kwargs)
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            if group is None or group not in check._host_groups:
                tensors = _tensors(args, []) + _tensors(kwargs, [])
                if name == "batch_isend_irecv":  # [P2POp]: each op's tensor, on its group
                    tensors = [op.tensor for op in args[0]]
                host = [tuple(t.shape) for t in tensors if check.is_host(t)]
                if host:
                    check._fail(f"torch.distributed.{name} of host tensors {host} on a device "
                                f"group: NCCL refuses them ('No backend type associated with "
                                f"device type cpu')")
            return original(*args, **kwargs)

        return collective

    def _active(self) -> bool:
        from torch.overrides import _get_current_function_mode_stack

        return any(mode is self for mode in _get_current_function_mode_stack())

    def _wrap_new_group(self, original):
        check = self

        def new_group(*args, **kwargs):
            group = original(*args, **kwargs)
            if kwargs.get("backend") == "gloo" and isinstance(group, dist.ProcessGroup):
                check._host_groups.add(group)
            return group

        return new_group

    def _patch(self, owner, name, value):
        self._patched[(owner, name)] = getattr(owner, name)
        setattr(owner, name, value)

    def _wrap_backward(self, original):
        """autograd's engine runs a custom Function's backward with no function mode: run it
        under this one, its incoming gradients on the device (where their outputs were)."""
        check = self

        def apply(node, *args):
            if check._active():
                return original(node, *args)
            check._mark_device(args)
            TorchFunctionMode.__enter__(check)  # the mode only, not __enter__'s patches
            try:
                return original(node, *args)
            finally:
                TorchFunctionMode.__exit__(check, None, None, None)

        return apply

    def __enter__(self):
        from torch.autograd.function import BackwardCFunction

        from megatron_lora.runtime import cpu_compat

        cpu_compat.install()
        self._patch(BackwardCFunction, "apply", self._wrap_backward(BackwardCFunction.apply))
        self._previous_rank = cpu_compat.set_rank_device(RANK)
        from torch.distributed import distributed_c10d as c10d

        for name in _COLLECTIVES:
            if hasattr(dist, name):
                self._patch(dist, name, self._wrap_collective(name, getattr(dist, name)))
        self._patch(dist, "new_group", self._wrap_new_group(c10d.new_group))
        self._patch(c10d, "new_group", dist.new_group)
        return super().__enter__()

    def __exit__(self, *exc):
        from megatron_lora.runtime import cpu_compat

        out = super().__exit__(*exc)
        for (owner, name), value in reversed(list(self._patched.items())):
            setattr(owner, name, value)
        self._patched.clear()
        cpu_compat.set_rank_device(self._previous_rank)
        return out

    # ---- what it saw -----------------------------------------------------------------------
    def reads_by_site(self, package_only: bool = True) -> Dict[str, int]:
        return dict(collections.Counter(r.site for r in self.reads
                                        if r.in_package or not package_only))

    def report(self) -> dict:
        return {"errors": self.errors, "steps": self.step,
                "reads": [dataclasses.asdict(r) for r in self.reads]}


def count_steps(check: DeviceCheck):
    """Make each call of the training loop's step (training.loop.forward_backward, not
    forward-only) start a new step in `check`'s reads."""
    from megatron_lora.training import loop

    original = loop.forward_backward

    def counted(*args, **kwargs):
        if not kwargs.get("forward_only"):
            check.step += 1
        return original(*args, **kwargs)

    check._patch(loop, "forward_backward", counted)
