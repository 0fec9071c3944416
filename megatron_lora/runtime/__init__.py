"""The only code in the package that knows how to start megatron-core (and about CUDA)."""

from megatron_lora.runtime.distributed import (
    accelerator_memory_bytes,
    current_layout,
    default_backend,
    destroy,
    device,
    init_process_group,
    initialize,
    misplaced,
    shutdown,
)
from megatron_lora.runtime.layout import LayoutError, ParallelLayout

__all__ = [
    "LayoutError",
    "ParallelLayout",
    "accelerator_memory_bytes",
    "current_layout",
    "default_backend",
    "destroy",
    "device",
    "init_process_group",
    "initialize",
    "misplaced",
    "shutdown",
]
