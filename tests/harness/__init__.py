"""Multi-rank test harness: write a test body once, run it on every rank of a reused world.

    @multirank(world_size=4)
    @pytest.mark.parametrize("layout", [ParallelLayout(tp=2, sp=True), ParallelLayout(ep=2)])
    def test_something(layout):
        ...  # runs on each of the 4 ranks, megatron initialised for `layout`

- The body runs on every rank; a failure on any rank fails the test with that rank's traceback.
- If the parameters include `layout` (a ParallelLayout), or the body declares one as a default
  (`def test_x(layout=ParallelLayout(tp=2, sp=True))`), megatron-core is initialised for it before
  the body and torn down after it, so the next test can use another layout in the same processes.
- `world_size` may be an int or a function of the test's parameters.
- Each test has a timeout (default 120 s, `timeout=`); a hung world is killed after its stuck ranks'
  stacks are printed, and the next test gets a fresh world.
- Parameters and fixtures passed to the body must be picklable (tmp_path is).
- On a machine with enough GPUs the worlds use NCCL, one GPU per rank; otherwise gloo on CPU.
- A world gets MLORA_TEST_START_TIMEOUT seconds (default 300) to start; a failed or slow start is
  retried once, said so on stderr, with a fresh port and twice that timeout.
"""

from __future__ import annotations

import atexit
import functools
import os
from typing import Any, Callable, Dict, Union

from tests.harness import registry
from tests.harness.world import World, WorldError, WorldTimeout

DEFAULT_TIMEOUT_S = float(os.environ.get("MLORA_TEST_TIMEOUT", "120"))
_WORLDS: Dict[int, World] = {}


def _backend_for(size: int):
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() >= size:
            return "nccl"
    except Exception:
        pass
    return "gloo"


def get_world(size: int) -> World:
    world = _WORLDS.get(size)
    if world is None or not world.alive():
        if world is not None:
            world.kill()
        world = World(size, _backend_for(size)).start()
        _WORLDS[size] = world
    return world


def close_worlds() -> None:
    for world in list(_WORLDS.values()):
        world.close()
    _WORLDS.clear()


atexit.register(close_worlds)


def run_on_world(size: int, key: str, kwargs: Dict[str, Any], timeout: float = DEFAULT_TIMEOUT_S):
    world = get_world(size)
    try:
        return world.run(key, kwargs, timeout)
    finally:
        if not world.alive():
            _WORLDS.pop(size, None)


def multirank(world_size: Union[int, Callable[..., int]], timeout: float = DEFAULT_TIMEOUT_S):
    """Decorate a test body so that it runs on every rank of a world of `world_size` ranks."""

    def decorate(fn):
        key = registry.register(fn)

        @functools.wraps(fn)
        def run(**kwargs):
            size = world_size(**kwargs) if callable(world_size) else world_size
            run_on_world(size, key, kwargs, timeout)

        return run

    return decorate


__all__ = ["multirank", "run_on_world", "get_world", "close_worlds", "WorldError", "WorldTimeout"]
