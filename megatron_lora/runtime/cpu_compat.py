"""Compatibility layer that lets megatron-core 0.16 run on machines without CUDA (gloo backend).

megatron-core assumes CUDA in a handful of places. Each fix below names the megatron-core call
site it answers and is installed only by `install()` when `torch.cuda.is_available()` is False; on
a GPU machine none of this code runs. This module (with the rest of `megatron_lora/runtime/`) is the
only place in the package that knows about CUDA-only calls.

Fixes (see `install()`):
  current_device    torch.cuda.current_device() used as a device everywhere (rotary_pos_embedding,
                    tensor_parallel.mappings, global memory buffer, DDP buffers, router)
  device_mode       hard-coded device="cuda" / .cuda() / .to("cuda") (transformer/utils.py causal
                    mask, pipeline_parallel/schedules.py total_num_tokens, tensor_parallel/data.py)
  tensor_type_names Tensor.type() compared with "torch.cuda.FloatTensor" by megatron's optimizers
                    and grad clipping (part of the device mode)
  streams           torch.cuda.Stream / current_stream / stream() (alltoall token dispatcher's
                    cuda_dtoh_stream, shared experts, DDP communication stream)
  rng_tracker       tensor_parallel.random.CudaRNGStatesTracker (model_parallel_cuda_manual_seed,
                    get_cuda_rng_tracker().fork() around init and dropout)
  router_gemm       moe_utils.router_gating_linear reads te_general_gemm, undefined without TE
  alltoall_splits   token_dispatcher's all_to_all gets its split sizes as CPU tensors (on a GPU
                    they are moved to host numpy arrays first); all_to_all_single wants lists
  uneven_gather     mappings._gather_along_first_dim / _reduce_scatter_along_first_dim with split
                    sizes (alltoall dispatcher under TP+SP) use list collectives gloo refuses
  recompute_rng     tensor_parallel.random._get_cuda_rng_state / _set_cuda_rng_state, reached from
                    _get_all_rng_states / _set_all_rng_states, which activation recomputation
                    (CheckpointFunction, CheckpointWithoutOutput) calls to save the RNG states
                    before a checkpointed forward and restore them before recomputing it
  recompute_device  the recomputed forward runs inside autograd's backward, where torch does not
                    apply the process's TorchFunctionMode (device_mode): CheckpointFunction.backward
                    and CheckpointWithoutOutput._recompute enter it again
  checkpoint_queue  dist_checkpointing's FileSystemWriterAsync collects its writers' results through
                    a Manager queue made with the "spawn" context (CUDA is not fork-safe): a fresh
                    interpreter that re-imports the caller's main module (torch, megatron-core),
                    about 5 s of CPU per process at its first checkpoint save. Without CUDA the
                    Manager is forked instead; its writers are forked already.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import threading
import time
from multiprocessing.managers import SyncManager
from typing import Dict

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

_INSTALLED: Dict[str, bool] = {}
# What each fix replaced, so tests can show that the original really fails on CPU.
ORIGINALS: Dict[str, object] = {}
_CPU = torch.device("cpu")
# The device a CPU rank computes on: plain "cpu", or "cpu:0" while testing/device_check.py tells
# the rank's device tensors from host ones (a "cpu:0" tensor is an ordinary CPU tensor).
_RANK_DEVICE = [_CPU]


def cuda_usable() -> bool:
    return torch.cuda.is_available()


def rank_device() -> torch.device:
    """What stands for this rank's CUDA device on CPU (runtime.device(), megatron's
    torch.cuda.current_device(), any CUDA `device=` argument)."""
    return _RANK_DEVICE[0]


def set_rank_device(device: torch.device) -> torch.device:
    """Make `device` (a CPU device) stand for the rank's device; returns the previous one."""
    if torch.device(device).type != "cpu":
        raise ValueError(f"a CPU rank's device must be a CPU device, got {device}")
    previous, _RANK_DEVICE[0] = _RANK_DEVICE[0], torch.device(device)
    return previous


# --------------------------------------------------------------------------------------------
# device_mode: rewrite hard-coded CUDA devices to CPU.
# --------------------------------------------------------------------------------------------
def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, int):
        return True  # a bare index means a CUDA ordinal in torch
    return False


class CpuDeviceMode(TorchFunctionMode):
    """Maps any CUDA `device=` argument, `Tensor.cuda()` and `Tensor.to("cuda")` to the CPU.

    Answers: transformer/utils.py `get_default_causal_mask` (device="cuda"),
    pipeline_parallel/schedules.py `total_num_tokens` (device="cuda"),
    tensor_parallel/data.py `broadcast_data` (.cuda()).

    Also (fix `tensor_type_names`): `Tensor.type()` without arguments reports the CUDA type name
    ("torch.cuda.FloatTensor"), because megatron's optimizers accept parameters by that name only
    (optimizer.py Float16OptimizerWithFloat16Params, distrib_optimizer.py
    _build_model_and_main_param_groups, clip_grads.py clip_grad_by_total_norm_fp32).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = dict(kwargs, device=rank_device())
        if kwargs.get("pin_memory"):
            kwargs = dict(kwargs, pin_memory=False)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], rank_device()) + tuple(args[2:])
        return func(*args, **kwargs)


# --------------------------------------------------------------------------------------------
# streams: a stream object that does nothing (CPU work is synchronous).
# --------------------------------------------------------------------------------------------
class NullStream:
    """Stands in for torch.cuda.Stream / Event on CPU: every method is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return NullStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, NullStream)

    def __hash__(self):
        return 0


_NULL_STREAM = NullStream()


# --------------------------------------------------------------------------------------------
# alltoall_splits / uneven_gather: gloo-safe collectives.
# --------------------------------------------------------------------------------------------
def _as_split_list(splits):
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        return [int(x) for x in splits.tolist()]
    return [int(x) for x in splits]


def _gloo_safe_gather_along_first_dim(original):
    """Uneven all-gather as: pad every piece to the largest split, gather evenly, trim."""

    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        splits = _as_split_list(output_split_sizes)
        largest = max(splits)
        padded = input_.new_zeros([largest] + list(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = input_.new_empty([largest * len(splits)] + list(input_.shape[1:]))
        dist.all_gather_into_tensor(gathered, padded.contiguous(), group=group)
        pieces = [gathered[i * largest : i * largest + n] for i, n in enumerate(splits)]
        return torch.cat(pieces, dim=0)

    return gather


def _gloo_safe_reduce_scatter_along_first_dim(original):
    """Uneven reduce-scatter as: all-reduce the whole tensor, keep this rank's split."""

    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return original(input_, group, input_split_sizes, use_global_buffer)
        splits = _as_split_list(input_split_sizes)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(splits[: group.rank()])
        return total[start : start + splits[group.rank()]].contiguous()

    return reduce_scatter


# --------------------------------------------------------------------------------------------
# recompute_rng: no CUDA generator to save or restore.
# --------------------------------------------------------------------------------------------
def _no_cuda_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Stands in for tensor_parallel.random._get_cuda_rng_state on CPU: an empty uint8 tensor.

    There is no CUDA generator to save. What a recomputed forward must see again is saved by
    megatron's own calls next to this one: the CPU default generator (`torch.get_rng_state()`,
    which dropout, and LoRA's dropout keys, draw from on CPU) and the named tracker streams
    (CpuRNGStatesTracker.get_states, CPU generator states)."""
    return torch.empty(0, dtype=torch.uint8, device="cpu")


def _set_no_cuda_rng_state(new_state=None, device: int = -1, graph_safe: bool = False) -> None:
    """Stands in for tensor_parallel.random._set_cuda_rng_state on CPU: nothing to restore."""


def _in_device_mode(fn):
    """`fn` run inside a CpuDeviceMode unless one is active already (recompute_device)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if any(isinstance(m, CpuDeviceMode) for m in _get_current_function_mode_stack()):
            return fn(*args, **kwargs)
        with CpuDeviceMode():
            return fn(*args, **kwargs)

    return run


def _exit_with_parent(parent_pid: int) -> None:
    """Run in the Manager's server process: exit when the process that forked it is gone. A
    Manager server outlives a killed parent (nothing tells it), and a forked one holds the
    parent's memory and sockets (torch.distributed's) open."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _forked_results_queue(original):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    @functools.wraps(original)
    def get(*args, **kwargs):
        if filesystem_async._results_queue is None:
            manager = SyncManager(ctx=mp.get_context("fork"))
            manager.start(_exit_with_parent, (os.getpid(),))
            filesystem_async._results_queue = manager.Queue()  # the proxy keeps `manager`
        return original(*args, **kwargs)  # returns the queue made above

    return get


# --------------------------------------------------------------------------------------------
# install
# --------------------------------------------------------------------------------------------
def install() -> Dict[str, bool]:
    """Install every CPU fix once per process; a no-op (returns {}) when CUDA is usable."""
    if cuda_usable():
        return {}
    if _INSTALLED:
        return dict(_INSTALLED)

    # current_device: megatron passes torch.cuda.current_device() as a `device=` argument.
    ORIGINALS["current_device"] = torch.cuda.current_device
    torch.cuda.current_device = rank_device
    _INSTALLED["current_device"] = True

    # streams
    torch.cuda.Stream = NullStream
    torch.cuda.Event = NullStream
    torch.cuda.current_stream = lambda *a, **k: _NULL_STREAM
    torch.cuda.default_stream = lambda *a, **k: _NULL_STREAM
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    _INSTALLED["streams"] = True

    # device_mode: entered for the life of the process.
    mode = CpuDeviceMode()
    mode.__enter__()
    _INSTALLED["device_mode"] = True
    _INSTALLED["tensor_type_names"] = True

    # rng_tracker
    from megatron_lora.runtime import rng

    rng.install_cpu_rng_tracker()
    _INSTALLED["rng_tracker"] = True

    # router_gemm
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _INSTALLED["router_gemm"] = True

    # alltoall_splits
    from megatron.core.transformer.moe import token_dispatcher

    original_all_to_all = token_dispatcher.all_to_all
    ORIGINALS["alltoall_splits"] = original_all_to_all

    # Keyword arguments pass through untouched: 0.18 added `use_nccl_stream` (see
    # runtime/versions.py), and whatever a later release adds must reach megatron as given.
    def all_to_all(group, input_, output_split_sizes=None, input_split_sizes=None, **kwargs):
        return original_all_to_all(
            group, input_, _as_split_list(output_split_sizes), _as_split_list(input_split_sizes),
            **kwargs,
        )

    token_dispatcher.all_to_all = all_to_all
    _INSTALLED["alltoall_splits"] = True

    # uneven_gather
    from megatron.core.tensor_parallel import mappings

    ORIGINALS["uneven_gather"] = mappings._gather_along_first_dim
    mappings._gather_along_first_dim = _gloo_safe_gather_along_first_dim(
        mappings._gather_along_first_dim
    )
    mappings._reduce_scatter_along_first_dim = _gloo_safe_reduce_scatter_along_first_dim(
        mappings._reduce_scatter_along_first_dim
    )
    _INSTALLED["uneven_gather"] = True

    # recompute_rng: _get_all_rng_states / _set_all_rng_states look these names up in the module
    # when called, so replacing the module attributes reaches every checkpoint function.
    from megatron.core.tensor_parallel import random as mrandom

    ORIGINALS["recompute_rng"] = mrandom._get_cuda_rng_state
    mrandom._get_cuda_rng_state = _no_cuda_rng_state
    mrandom._set_cuda_rng_state = _set_no_cuda_rng_state
    _INSTALLED["recompute_rng"] = True

    # recompute_device: autograd looks `backward` up on the Function class at each call, and
    # CheckpointWithoutOutput registers its bound `_recompute` as a hook after this runs.
    ORIGINALS["recompute_device"] = mrandom.CheckpointFunction.backward
    mrandom.CheckpointFunction.backward = staticmethod(
        _in_device_mode(mrandom.CheckpointFunction.backward))
    mrandom.CheckpointWithoutOutput._recompute = _in_device_mode(
        mrandom.CheckpointWithoutOutput._recompute)
    _INSTALLED["recompute_device"] = True

    # checkpoint_queue: 0.16 calls _get_write_results_queue(), 0.19 get_write_results_queue(
    # mp_mode); both cache the queue in the module global _results_queue, looked up at call time.
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    for name in ("_get_write_results_queue", "get_write_results_queue"):
        if hasattr(filesystem_async, name):
            ORIGINALS["checkpoint_queue"] = getattr(filesystem_async, name)
            setattr(filesystem_async, name, _forked_results_queue(getattr(filesystem_async, name)))
    _INSTALLED["checkpoint_queue"] = "checkpoint_queue" in ORIGINALS
    return dict(_INSTALLED)


def installed() -> Dict[str, bool]:
    return dict(_INSTALLED)
