"""Importing megatron-core without the work it does at import for features we never use.

Every rank of every command imports megatron-core, so its import time is paid once per process
(several seconds of CPU each on a 2-core machine, more than a tiny model's whole step). Two parts
of it are pure waste for this package:

- `megatron.core.jit` sets `jit_fuser = torch.compile`, and every `@jit_fuser` at import calls
  `torch.compile(fn)`, which imports TorchDynamo and Inductor (about 2 s of CPU) for fused kernels
  that run only if a config enables them. While megatron-core imports, `torch.compile(fn)`
  returns a function that compiles on its first call instead: nothing changes for a kernel that
  runs, and nothing is imported for one that never does. Without CUDA the function runs eagerly
  instead (the same math, unfused): Inductor's CPU code generation costs about 4 s per process for
  each kernel (a C++ build), far more than it saves at any shape a CPU run uses, and the MoE
  router calls one (`_apply_expert_bias`, a no-op unless expert bias is on) in every forward.
- `megatron.core.inference.contexts.dynamic_context` imports `wandb` when it is installed (about
  1 s) for its own inference logging, which this package does not use. While megatron-core
  imports, `import wandb` fails as if it were not installed; afterwards it imports normally, so
  `train --wandb-project` (`megatron_lora/training/logging.py`) is unaffected.

`install()` (called by `megatron_lora/__init__.py`) puts a one-shot finder on `sys.meta_path` that
wraps the execution of `megatron.core`'s `__init__` (which imports the rest); it does nothing if
megatron-core is already imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.util
import sys


@contextlib.contextmanager
def _lazy_torch_compile():
    import torch

    real = torch.compile

    def lazy(model=None, **kwargs):
        if model is None or kwargs:  # torch.compile(mode=...) as a decorator factory: as is
            return real(model, **kwargs) if model is not None else real(**kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = real(model) if torch.cuda.is_available() else model
            return compiled(*args, **kw)

        return call

    torch.compile = lazy
    try:
        yield
    finally:
        torch.compile = real


@contextlib.contextmanager
def _without(module: str):
    if module in sys.modules:  # already imported by the caller: leave it be
        yield
        return
    sys.modules[module] = None  # `import module` raises ImportError
    try:
        yield
    finally:
        if sys.modules.get(module, 0) is None:
            del sys.modules[module]


class _LeanLoader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self._inner
        with _lazy_torch_compile(), _without("wandb"):
            self._inner.exec_module(module)

    def __getattr__(self, name):  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self._inner, name)


class _MegatronCoreFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "megatron.core":
            return None
        sys.meta_path.remove(self)  # one shot; also lets find_spec below see the real finders
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _LeanLoader(spec.loader)
        return spec


def install() -> None:
    if "megatron.core" in sys.modules or any(isinstance(f, _MegatronCoreFinder)
                                             for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _MegatronCoreFinder())
