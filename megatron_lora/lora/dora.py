"""DoRA (weight-decomposed LoRA, PEFT's `use_dora`) on a megatron column- or row-parallel linear.

A DoRA adapter adds a trainable magnitude vector m [out] to the LoRA pair and computes

    out = base(x) + (m / n - 1) * W d + (m / n) * scale * B A d,   n = ||W + scale * B A||_row

where d = dropout(x) on the LoRA path (d = x when dropout is off or in eval mode, and then
W d is the base output without its bias, so out = m / n * (W x + scale * B A x) + bias), and
n [out] is the L2 norm over the input dimension of each output row, detached from autograd (the
DoRA paper's section 4.3, as PEFT does). This is PEFT's DoraLinearLayer formula term for term.

Parallel layout (t = size of the base's group: the TP group, the expert-TP group for experts):
    column base (W [out/t, in]):  m [out/t] sharded on dim 0 like W (with W's partition stride:
        a gated fc1's rank k holds [gate_k; up_k]); each rank's rows of W + scale B A are
        complete, so n is local: no communication.
    row base (W [out, in/t]):  m [out] replicated; each rank holds a column slice of every row,
        so the squared row norms are partial sums: one all-reduce of an [out] fp32 vector over
        the base's own group each time the norm is formed (once per training step, once per
        forward outside one, once per merge), never of an activation.
Gradients of m: complete on every rank, except where each rank's output covers different
tokens (row base under SP: m carries `sequence_parallel = True`, summed with the layer norms by
finalize_model_grads) or holds a partial sum (expert row base with expert-TP: `grad_sum` inside
autograd, like its B factor).

Dropout > 0 in training needs W d, the base applied to the dropped input: the base layer is
called a second time on d (its own collectives: for a dense TP > 1 base under SP that is one more
all-gather / reduce-scatter of the dropped input, the price of PEFT's formula; with dropout 0 or
in eval nothing is added). d uses the layout-independent masks of dropout.py, the same elements
the LoRA path drops.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatron_lora.lora.dropout import keep_mask, keep_mask_at
from megatron_lora.lora.parallel import COLUMN, ROW

MAGNITUDE = "lora_magnitude_vector"


def _group_size(group) -> int:
    return 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)


@torch.no_grad()
def squared_row_norms(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      scaling: float) -> torch.Tensor:
    """fp32 [out_local]: sum over this rank's input columns of (W + scaling * B A)^2.

    weight [out_local, in_local] (this rank's shard), lora_b [out_local, r], lora_a [r, in_local].
    """
    merged = torch.addmm(weight.detach().float(), lora_b.detach().float(),
                         lora_a.detach().float(), alpha=float(scaling))
    return merged.square_().sum(dim=1)


def base_weight(layer) -> torch.Tensor:
    """The base's weight [out_local, in_local] on its device: an NF4 base's dequantised (once,
    explicitly, by its own method) in its stored dtype, the values its `weight` reads give."""
    return layer.dequantized_weight() if getattr(layer, "nf4", False) else layer.weight


@torch.no_grad()
def weight_norm(adapter, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 [out_local] = ||W + scale * B A||_row for this rank's output rows, detached.

    Row-parallel bases (input dimension split over the group) sum the squared norms over the
    base's own group: one all-reduce of [out] (adapter.geometry.tp_group)."""
    weight = base_weight(adapter.base_layer) if weight is None else weight
    sq = squared_row_norms(weight, adapter.lora_A, adapter.lora_B, adapter.scaling)
    return complete_squared_norms(sq, adapter.geometry).sqrt_()


def complete_squared_norms(sq: torch.Tensor, geometry) -> torch.Tensor:
    """Squared row norms [..., out] summed over a row base's group (each rank holds a column
    slice of every row): one all-reduce, in place; column bases' are complete already."""
    if geometry.mode == ROW and _group_size(geometry.tp_group) > 1:
        dist.all_reduce(sq, group=geometry.tp_group)
    return sq


# The training step in progress (training/step.py): while it runs, A, B and the base keep their
# values (the optimizer steps after it), so each adapter forms its norm once and every
# micro-batch, and a recomputed forward, reuses it. None outside a step: formed every forward.
_STEP: list = [None]
_NORM_CACHE = "_dora_step_norm"  # adapter attribute: (the step, its norm), not state


def begin_step() -> None:
    """A training step's forwards begin (its factors fixed until end_step)."""
    _STEP[0] = object()


def end_step() -> None:
    _STEP[0] = None


def step_weight_norm(adapter) -> torch.Tensor:
    """weight_norm(adapter), formed once per training step (begin_step .. end_step) and reused
    by the step's other forwards; every forward outside a step forms it. No host read decides
    it, and every rank of a row base's group forms it at the same forward (each runs the same
    micro-batches of the same step), so they join its all-reduce together."""
    return step_cached(adapter, lambda: weight_norm(adapter))


def step_cached(owner, compute):
    """compute() once per training step for `owner` (kept in its __dict__), every call outside
    a step (see step_weight_norm)."""
    step = _STEP[0]
    if step is None:
        return compute()
    cached = owner.__dict__.get(_NORM_CACHE)
    if cached is not None and cached[0] is step:
        return cached[1]
    norm = compute()
    owner.__dict__[_NORM_CACHE] = (step, norm)
    return norm


def dropped_input(x: torch.Tensor, p: float, key: torch.Tensor, token_offset: int,
                  feature_offset: int, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """dropout_p(x) with the LoRA path's mask (dropout.py), differentiable in x.

    x [..., F] this rank's input; token_offset / feature_offset: where its rows and columns start
    in the global input; rows: int64 global token index of each row (experts), else None."""
    x2 = x.reshape(-1, x.shape[-1])
    if rows is not None:
        mask = keep_mask_at(key, p, rows, feature_offset, x2.shape[1])
    else:
        mask = keep_mask(key, p, token_offset, x2.shape[0], feature_offset, x2.shape[1])
    return (x2 * (mask.to(x2.dtype) * (1.0 / (1.0 - p)))).view(x.shape)


def added_bias(adapter, returned_bias) -> Optional[torch.Tensor]:
    """The bias the base layer added into its output (None when skip_bias_add or no bias)."""
    if returned_bias is not None:
        return None
    bias = getattr(adapter.base_layer, "bias", None)
    if not isinstance(bias, torch.Tensor) or bias.numel() == 0:
        return None
    return bias


def combine(output: torch.Tensor, base_result: torch.Tensor, lora: torch.Tensor,
            mag_norm_scale: torch.Tensor) -> torch.Tensor:
    """PEFT's result + (m/n - 1) * base_result + (m/n) * lora, m/n broadcast over the last dim."""
    s = mag_norm_scale.to(output.dtype)
    return output + (s - 1.0) * base_result + s * lora.to(output.dtype)


def check_dora_base(geometry) -> None:
    """Layers DoRA cannot wrap exactly raise here, before anything is allocated."""
    if geometry.weight_at_forward:
        raise ValueError(
            "--lora-use-dora: the output layer with tied embeddings has no weight of its own "
            "(it is handed the word embedding at forward); DoRA needs the weight's row norms. "
            "Leave output_layer out of --lora-target-modules"
        )
    if geometry.mode == COLUMN and geometry.gather_output and geometry.stride != 1:
        raise ValueError("--lora-use-dora: a column layer with gather_output and partition "
                         "stride > 1 is not supported")


__all__ = ["MAGNITUDE", "added_bias", "check_dora_base", "combine", "complete_squared_norms",
           "dropped_input",
           "base_weight", "begin_step", "end_step", "squared_row_norms", "step_cached",
           "step_weight_norm",
           "weight_norm"]
