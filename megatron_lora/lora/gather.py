"""The global factors of an adapter, assembled from every rank's shards (for export and tests).

`global_factors(adapter)` is collective over the adapter's own group (the dense TP group, or
expert-TP for experts) and returns the global (A, B) in the layouts docs/lora.md lists:
column base: A [r, in], B [out, r]; row base: A [r, in], B [out, r]. A column base held with
partition stride s (a gated fc1: rank k holds [gate_k; up_k]) is un-strided, so B's rows come
back in the weight's global order ([gate; up]). Experts are not gathered over EP here: each EP
rank returns its own experts' pairs, keyed by `adapter.global_expert`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lora.lora.parallel import COLUMN


def _gather(t: torch.Tensor, group, size: int) -> list:
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return parts


def unstride(parts: list, dim: int, stride: int) -> torch.Tensor:
    """Rank-ordered shards of a tensor split with megatron's partition stride -> the global one.
    Rank k's shard is [chunk k; chunk k + t; ...] (stride chunks); the global order interleaves
    them back: chunk j*t + k = part k's j-th piece."""
    if stride == 1:
        return torch.cat(parts, dim=dim)
    pieces = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([pieces[k][j] for j in range(stride) for k in range(len(parts))], dim=dim)


@torch.no_grad()
def global_factors(adapter) -> tuple:
    """(A, B) global, detached, on every rank of the adapter's group (collective; the router's
    pair is replicated, global = local: no collective)."""
    from megatron_lora.lora.expert_lora import ExpertLora

    if isinstance(adapter, ExpertLora):
        raise TypeError("global_factors takes one expert's pair: pass adapter.expert(e) (or "
                        "each of adapter.experts()) of a stacked ExpertLora")
    g = getattr(adapter, "geometry", None)
    if g is None:  # RouterLora: A [r, h], B [E, r] on every rank
        return adapter.lora_A.detach().clone(), adapter.lora_B.detach().clone()
    a, b = adapter.lora_A.detach(), adapter.lora_B.detach()
    if g.tp_size == 1:
        return a.clone(), b.clone()
    if g.mode == COLUMN:
        return a.clone(), unstride(_gather(b, g.tp_group, g.tp_size), 0, g.stride)
    return torch.cat(_gather(a, g.tp_group, g.tp_size), dim=1), b.clone()


__all__ = ["global_factors", "unstride"]
