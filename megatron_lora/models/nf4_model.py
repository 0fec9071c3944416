"""`--base-quantization nf4`: hold every frozen decoder linear of a loaded model in NF4.

    problems = nf4_layout_problems(info.shape, layout)   # before any collective (CLI checks)
    quantize_base(model)                                 # after the base weights are loaded
    quantize_linear_(name, linear, weight)               # one linear, from its read shard

Quantised: every megatron Column/RowParallelLinear inside the decoder (attention projections,
each routed expert's fc1 / fc2, shared experts, dense MLPs). The router, embeddings, output layer
and norms keep the base dtype, as in QLoRA. Apply LoRA afterwards: the adapters wrap the NF4
linears as they wrap full-precision ones.

Layout invariance: each weight is quantised as its GLOBAL matrix (each expert's on its own): a
linear sharded over its group (the TP group, the expert-TP group for experts; EP only places
whole experts) all-gathers its shards, bitsandbytes quantises the whole matrix on CPU, and the
rank keeps the blocks of its own shard (models/nf4.py). So the values are the same at every
TP/EP/ETP/PP layout. One linear at a time: the transient extra is one global weight and its
codes, and each full-precision weight is released as soon as its NF4 form is in place.

Memory while loading. `quantize_base` converts a model already loaded in full precision, so the
rank first holds its whole full-precision model. To bound the peak, build the model inside
models.nf4_deferred.deferred_decoder_linears (the decoder linears get meta weights: no storage)
and load it with convert/load_nf4.load_nf4, which reads one linear's shard at a time and hands
it to `quantize_linear_`: the rank's peak during build and load is its packed linears, its
other tensors (embeddings, output layer, norms, routers), and one linear's transient (its
shard, its gathered global weight, the packed global weight, a reader's cached chunk), never
its full-precision model. train, logits and generate load that way (cli/model_setup.build_base);
the values are bit for bit those of loading in full precision and then `quantize_base`.

A shard must hold whole blocks of 64 input columns: row-parallel linears (attention output
projection, fc2) need (input width / their TP or expert-TP size) % 64 == 0, every linear an
input width divisible by 64. `nf4_layout_problems` says which flag and width do not fit.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_lora.models.nf4 import BLOCK, quantize_parts
from megatron_lora.models.nf4_linear import held_bytes, is_nf4, to_nf4_

CHOICES = ("none", "nf4")


class NF4LayoutError(ValueError):
    """A model or layout whose NF4 shards would split a block of 64; the message says which."""


def nf4_layout_problems(shape, layout) -> List[str]:
    """What keeps `shape` (families.ModelShape) from NF4 at `layout` (one line per problem,
    naming the flag or config field and the width); [] when it fits."""
    kv = shape.kv_channels or shape.hidden_size // shape.num_attention_heads
    widths = [  # (what, global input width, ranks sharding it, the flag for them)
        ("hidden_size (input of linear_qkv and fc1)", shape.hidden_size, 1, None),
        ("num_attention_heads x kv_channels (input of linear_proj)",
         shape.num_attention_heads * kv, layout.tp, "--tensor-model-parallel-size"),
    ]
    if shape.mla is not None:  # multi-latent attention's inputs (MlaShape.linear_shapes)
        m = shape.mla
        widths[1] = ("num_attention_heads x v_head_dim (input of linear_proj)",
                     shape.num_attention_heads * m.v_head_dim, layout.tp,
                     "--tensor-model-parallel-size")
        widths.append(("kv_lora_rank (input of linear_kv_up_proj)", m.kv_lora_rank, 1, None))
        if m.q_lora_rank:
            widths.append(("q_lora_rank (input of linear_q_up_proj)", m.q_lora_rank, 1, None))
    if shape.num_experts:
        widths.append(("moe_ffn_hidden_size (input of each expert's fc2)",
                       shape.ffn_hidden_size, layout.expert_tp, "--expert-tensor-parallel-size"
                       if layout.etp is not None else "--tensor-model-parallel-size"))
    else:
        widths.append(("ffn_hidden_size (input of fc2)", shape.ffn_hidden_size, layout.tp,
                       "--tensor-model-parallel-size"))
    if shape.shared_expert_ffn_hidden_size:
        widths.append(("shared_expert_ffn_hidden_size (input of the shared expert's fc2)",
                       shape.shared_expert_ffn_hidden_size, layout.tp,
                       "--tensor-model-parallel-size"))
    problems = []
    for what, width, ranks, flag in widths:
        if width % ranks == 0 and (width // ranks) % BLOCK == 0:
            continue
        if ranks == 1:
            problems.append(f"--base-quantization nf4: {what} = {width} is not a multiple of "
                            f"{BLOCK} (NF4 blocks are {BLOCK} input columns of one row); this "
                            "model cannot be held in NF4")
        else:
            problems.append(f"--base-quantization nf4: {what} = {width} split over {flag} "
                            f"{ranks} gives {width / ranks:g} input columns per rank, not a "
                            f"multiple of {BLOCK} (NF4 blocks are {BLOCK} input columns of one "
                            f"row); use a smaller {flag}{_etp1_hint(what, width)}")
    return problems


def _etp1_hint(what: str, width: int) -> str:
    """For the experts' width split into partial blocks: expert-TP 1 keeps each expert whole on
    its rank (whole blocks when the width is) while the dense layers keep their TP."""
    if not what.startswith("moe_ffn_hidden_size") or width % BLOCK:
        return ""
    return " (--expert-tensor-parallel-size 1 keeps each expert whole on its rank)"


def _targets(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megatron_lora.lora.adapter import LoraAdapter
    from megatron_lora.lora.experts import ExpertSlot

    found = []
    for name, module in model.named_modules():
        if ".decoder." not in f".{name}" or is_nf4(module):
            continue
        if isinstance(module, (LoraAdapter, ExpertSlot)):
            # Its DoRA norms and its view of the base would be the full-precision weight's.
            raise NF4LayoutError(f"--base-quantization nf4: {name} already has a LoRA adapter; "
                                 "quantise the base first, then apply_lora")
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            found.append((name, module))
        elif hasattr(module, "parallel_mode") and hasattr(module, "weight"):
            raise NF4LayoutError(
                f"--base-quantization nf4 holds megatron-core's local linears; {name} is a "
                f"{type(module).__name__} (Transformer Engine): use the local layers "
                "(--transformer-impl local)")
    return found


def _group(linear):
    group = getattr(linear, "tp_group", None)
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return None, 1, 0
    return group, dist.get_world_size(group), dist.get_rank(group)


def _check(name: str, linear) -> None:
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    _, size, _ = _group(linear)
    k = linear.weight.shape[1]
    if k % BLOCK == 0:
        return
    if isinstance(linear, RowParallelLinear) and size > 1:
        flag = ("--expert-tensor-parallel-size" if getattr(linear, "is_expert", False)
                else "--tensor-model-parallel-size")
        whole = getattr(linear, "is_expert", False) and (k * size) % BLOCK == 0
        raise NF4LayoutError(
            f"--base-quantization nf4: {name} holds {k} input columns per rank ({flag} {size}),"
            f" not a multiple of {BLOCK}; use a smaller {flag}"
            + (" (--expert-tensor-parallel-size 1 keeps each expert whole on its rank)"
               if whole else ""))
    raise NF4LayoutError(f"--base-quantization nf4: {name} has {k} input columns, not a "
                         f"multiple of {BLOCK}; this model cannot be held in NF4")


def _global_weight(linear, w: torch.Tensor, group, size: int) -> torch.Tensor:
    """The whole [out, in] weight of a linear sharded over `group` (megatron's layout), from
    this rank's shard w."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    if size == 1:
        return w
    parts = [torch.empty_like(w) for _ in range(size)]
    dist.all_gather(parts, w.contiguous(), group=group)
    if not isinstance(linear, ColumnParallelLinear):
        return torch.cat(parts, dim=1)
    stride = int(getattr(linear.weight, "partition_stride", 1) or 1)
    chunk = w.shape[0] // stride  # rank k holds global chunks k, k + size, ... (stride of them)
    return torch.cat([parts[c % size][(c // size) * chunk:(c // size + 1) * chunk]
                      for c in range(size * stride)])


def _segments(name: str, linear, rows: int):
    """The parts a megatron weight fuses, as (part, first part row, rows) runs in its row order:
    linear_qkv: per query group its q heads, k head, v head (parts q, k, v); a gated fc1: gate
    rows then up rows (parts gate, up); anything else: one part."""
    cfg = linear.config
    if name.endswith("linear_qkv"):
        groups = cfg.num_query_groups or cfg.num_attention_heads
        d = cfg.kv_channels
        per_group = cfg.num_attention_heads // groups * d
        if rows != groups * (per_group + 2 * d):
            raise NF4LayoutError(f"{name}: {rows} rows do not fit q/k/v of {groups} groups")
        out = []
        for j in range(groups):
            out += [(0, j * per_group, per_group), (1, j * d, d), (2, j * d, d)]
        return out
    if name.endswith("linear_fc1") and cfg.gated_linear_unit:
        return [(0, 0, rows // 2), (1, 0, rows // 2)]
    return [(0, 0, rows)]


def _local_shard(linear, packed, size: int, rank: int):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    if size == 1:
        return packed
    m, k = linear.weight.shape
    if isinstance(linear, ColumnParallelLinear):
        stride = int(getattr(linear.weight, "partition_stride", 1) or 1)
        chunk = m // stride  # rank k holds global chunks k, k + size, ... of the fused weight
        return packed.rows([((j * size + rank) * chunk, chunk) for j in range(stride)])
    return packed.columns(rank * k, k)


def check_targets(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """The decoder linears quantize_base converts, each checked (NF4LayoutError naming it);
    local, no collective. Works on deferred (meta) weights too (models/nf4_deferred.py)."""
    targets = _targets(model)
    for name, linear in targets:
        if getattr(linear, "weight", None) is None:
            raise NF4LayoutError(f"--base-quantization nf4: {name} has no weight of its own")
        _check(name, linear)
    return targets


@torch.no_grad()
def quantize_linear_(name: str, linear, weight: Optional[torch.Tensor] = None) -> None:
    """Hold one checked decoder linear in NF4, in place. weight: this rank's full-precision
    shard [out_local, in_local] (default: the linear's own weight; give it for a deferred one),
    on the device its NF4 buffers go to. Collective over the linear's group (TP or expert-TP):
    the group's ranks call it for the same linear. Transient: the global weight and its codes."""
    group, size, rank = _group(linear)
    local = linear.weight.detach() if weight is None else weight.detach()
    w = _global_weight(linear, local, group, size)
    packed = quantize_parts(w, _segments(name, linear, w.shape[0]))
    del w
    to_nf4_(linear, _local_shard(linear, packed, size, rank), device=local.device)


def quantize_base(model: torch.nn.Module) -> int:
    """Hold every decoder Column/RowParallelLinear of `model` (this rank's stage) in NF4, in
    place; returns how many were converted. Collective over each linear's own group (TP or
    expert-TP): call on every rank, after loading the base weights and before apply_lora.
    Every linear is checked (NF4LayoutError) before the first collective."""
    targets = check_targets(model)
    for name, linear in targets:
        quantize_linear_(name, linear)
    return len(targets)


def nf4_held(model: torch.nn.Module) -> Tuple[int, int]:
    """(bytes held, parameters represented) by this rank's NF4 linears."""
    held = params = 0
    for module in model.modules():
        if is_nf4(module):
            held += held_bytes(module)
            params += module.nf4_codes.numel() * 2
    return held, params


__all__ = ["CHOICES", "NF4LayoutError", "check_targets", "nf4_held", "nf4_layout_problems",
           "quantize_base", "quantize_linear_"]
