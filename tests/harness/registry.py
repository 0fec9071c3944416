"""Bodies that rank processes can run, found by "module:qualname" key."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable, Dict

_BODIES: Dict[str, Callable[..., Any]] = {}


def register(fn: Callable[..., Any]) -> str:
    key = f"{fn.__module__}:{fn.__qualname__}"
    _BODIES[key] = fn
    return key


def execute(key: str, kwargs: Dict[str, Any]) -> None:
    """Run body `key` on this rank: initialise megatron for its `layout` (a parameter, or the
    default value of the body's `layout` argument) if any; always tear megatron down afterwards so
    the next task starts clean."""
    from megatron_lora import runtime
    from megatron_lora.runtime import ParallelLayout

    if key not in _BODIES:
        importlib.import_module(key.split(":")[0])
    body = _BODIES[key]
    layout = kwargs.get("layout", _default_layout(body))
    try:
        if isinstance(layout, ParallelLayout):
            runtime.initialize(layout, seed=kwargs.get("seed", 1234))
        body(**kwargs)
    finally:
        runtime.destroy()


def _default_layout(body):
    """A body may fix its layout as a default argument: def test_x(layout=ParallelLayout(tp=2))."""
    param = inspect.signature(body).parameters.get("layout")
    if param is None or param.default is inspect.Parameter.empty:
        return None
    return param.default
