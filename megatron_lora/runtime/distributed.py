"""Start and stop megatron-core on the current processes.

`initialize(layout, ...)` is the one way the package starts megatron-core: it starts
torch.distributed if needed (NCCL when CUDA is usable, gloo otherwise), validates the layout on
every rank before any collective, builds megatron's parallel groups and seeds the RNG streams.
`destroy()` undoes the megatron part so another layout can be initialised in the same processes.
"""

from __future__ import annotations

import datetime
import os
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron_lora.runtime import cpu_compat, gloo_device, watchdog
from megatron_lora.runtime.layout import ParallelLayout

_CURRENT: Optional[ParallelLayout] = None
# Process groups that existed before megatron built its own; destroy() frees only the others.
_GROUPS_BEFORE: Optional[set] = None


def data_parallel_slice(batch: torch.Tensor) -> torch.Tensor:
    """This DP rank's contiguous share of a global batch [B, ...] (B divisible by DP)."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    if batch.shape[0] % dp:
        raise ValueError(f"global batch {batch.shape[0]} is not divisible by data parallel size {dp}")
    per = batch.shape[0] // dp
    return batch[rank * per : (rank + 1) * per]


def default_backend() -> str:
    return "nccl" if cpu_compat.cuda_usable() else "gloo"


def device() -> torch.device:
    """The device this rank computes on: its CUDA device on a GPU machine, else the CPU."""
    if cpu_compat.cuda_usable():
        return torch.device("cuda", torch.cuda.current_device())
    return cpu_compat.rank_device()


def misplaced(module: torch.nn.Module) -> List[str]:
    """Names of `module`'s parameters not on this rank's device (meta ones, not yet loaded,
    aside)."""
    here = device()
    return [name for name, p in module.named_parameters() if not p.is_meta and p.device != here]


def accelerator_memory_bytes() -> Optional[int]:
    """Total memory of the GPU this rank will use (its LOCAL_RANK's), or None without CUDA.
    Usable before init_process_group, for checks that run before anything is allocated."""
    if not cpu_compat.cuda_usable():
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.cuda.get_device_properties(local_rank % torch.cuda.device_count()).total_memory


def init_process_group(
    backend: Optional[str] = None, timeout_s: float = 600.0, **init_kwargs
) -> None:
    """Start torch.distributed from the torchrun environment (RANK, WORLD_SIZE, MASTER_*).

    Under torchrun this rank is also made to exit when the launcher dies (runtime.watchdog)."""
    watchdog.watch_launcher()
    cpu_compat.install()
    if dist.is_initialized():
        return
    backend = backend or default_backend()
    if backend == "gloo":
        gloo_device.install()  # before the first group: the world group shares the device too
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **init_kwargs
    )


def initialize(
    layout: ParallelLayout = ParallelLayout(),
    *,
    seed: int = 1234,
    backend: Optional[str] = None,
    model_sizes: Optional[dict] = None,
) -> ParallelLayout:
    """Initialise megatron-core's parallel state for `layout` on the running world.

    Raises LayoutError (a ValueError) on every rank, before any collective, when the layout does
    not fit the world size or the model sizes given in `model_sizes` (keys as in
    `ParallelLayout.problems`).
    """
    from megatron.core import parallel_state

    global _CURRENT
    cpu_compat.install()
    if not dist.is_initialized():
        init_process_group(backend)
    world_size = dist.get_world_size()
    layout.validate(world_size, **(model_sizes or {}))
    if _CURRENT is not None or parallel_state.model_parallel_is_initialized():
        destroy()
    global _GROUPS_BEFORE
    _GROUPS_BEFORE = set(_live_groups())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
    )
    from megatron_lora.runtime.rng import seed_everything

    seed_everything(seed)
    _CURRENT = layout
    return layout


def _reset_moe_globals() -> None:
    """megatron keeps MoE state in class and module globals that outlive a layout: the aux-loss
    backward scale adopts the first tensor it is given (its shape included), and the aux-loss
    tracker keeps per-layer tensors."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    tracker = getattr(parallel_state, "_MOE_LAYER_WISE_LOGGING_TRACKER", None)
    if isinstance(tracker, dict):
        tracker.clear()


def _live_groups():
    if not dist.is_initialized():
        return []
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map.keys())


def current_layout() -> Optional[ParallelLayout]:
    return _CURRENT


def destroy() -> None:
    """Tear down megatron's parallel state and global buffers; torch.distributed stays up."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    global _CURRENT, _GROUPS_BEFORE
    parallel_state.destroy_model_parallel()
    destroy_num_microbatches_calculator()
    _reset_moe_globals()
    # megatron forgets its groups without destroying them; each gloo group keeps its threads and
    # sockets, so processes that initialise many layouts would pile them up.
    if _GROUPS_BEFORE is not None and dist.is_initialized():
        for group in _live_groups():
            if group not in _GROUPS_BEFORE and group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)
    _GROUPS_BEFORE = None
    _CURRENT = None


def shutdown() -> None:
    """destroy() and then stop torch.distributed."""
    destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
