"""One line saying what a built model computes with: device, backend, attention, experts, TE.

    megatron-lora: cuda:0 (NVIDIA H200, 139.8 GiB), nccl, 8 ranks | attention: torch SDPA |
    experts: grouped GEMM (torch._grouped_mm) | Transformer Engine: no | apex: no

Printed once per process, by rank 0, to stderr (stdout may carry a command's output), when a
command has built its model (cli/model_setup.py), so a log says which kernels a run used. The
model's modules are told apart by type.
"""

from __future__ import annotations

import importlib.util
import sys

import torch
import torch.distributed as dist
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

from megatron_lora import runtime
from megatron_lora.models.attention import SDPAttention
from megatron_lora.models.grouped_experts import GroupedExperts

_SAID = [False]


def _device() -> str:
    here = runtime.device()
    if here.type == "cuda":
        props = torch.cuda.get_device_properties(here)
        return f"{here} ({props.name}, {props.total_memory / 2**30:.1f} GiB)"
    threads = torch.get_num_threads()
    return f"{here.type} ({threads} thread{'s' if threads != 1 else ''})"


def _sdpa_kernels() -> str:
    if runtime.device().type != "cuda":
        return ""
    b = torch.backends.cuda
    kernels = (("flash", b.flash_sdp_enabled()),
               ("memory-efficient", b.mem_efficient_sdp_enabled()),
               ("cuDNN", b.cudnn_sdp_enabled()), ("math", b.math_sdp_enabled()))
    on = [name for name, enabled in kernels if enabled]
    return f" ({', '.join(on)} kernels enabled)"


def _attention(model) -> str:
    kinds = set()
    for module in model.modules():
        if isinstance(module, SDPAttention):
            kinds.add("torch SDPA" + _sdpa_kernels())
        elif isinstance(module, DotProductAttention):
            kinds.add("megatron DotProductAttention (unfused)")
        elif type(module).__module__.startswith("megatron.core.extensions.transformer_engine") \
                and "Attention" in type(module).__name__:
            kinds.add("Transformer Engine")
    return ", ".join(sorted(kinds)) or "none on this stage"


def _experts(model) -> str:
    grouped = any(isinstance(m, GroupedExperts) for m in model.modules())
    sequential = any(isinstance(m, SequentialMLP) and not isinstance(m, GroupedExperts)
                     for m in model.modules())
    if grouped:
        on_device = runtime.device().type == "cuda" and hasattr(torch, "_grouped_mm")
        return ("grouped GEMM (torch._grouped_mm)" if on_device else
                "grouped experts (a loop of matmuls on CPU)")
    if sequential:
        return "a loop over experts (SequentialMLP)"
    if any(isinstance(m, TEGroupedMLP) for m in model.modules()):
        return "Transformer Engine's grouped GEMM (TEGroupedMLP)"
    return "none on this stage"


def _installed(name: str) -> str:
    return "yes" if importlib.util.find_spec(name) is not None else "no"


def describe(model) -> str:
    backend = dist.get_backend() if dist.is_initialized() else "no process group"
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    return (f"megatron-lora: {_device()}, {backend}, {ranks} rank{'s' if ranks != 1 else ''} | "
            f"attention: {_attention(model)} | experts: {_experts(model)} | "
            f"Transformer Engine: {_installed('transformer_engine')} | apex: {_installed('apex')}")


def announce(model) -> None:
    """Print describe(model) once per process, on rank 0."""
    if _SAID[0] or (dist.is_initialized() and dist.get_rank() != 0):
        return
    _SAID[0] = True
    print(describe(model), file=sys.stderr, flush=True)
