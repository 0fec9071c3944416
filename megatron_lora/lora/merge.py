"""Merge a LoRA update into the base weight shard on each rank, and take it out again.

The update scale * B @ A has the base weight's sharding on every rank without communication:
- column: B [out/t, r] @ A [r, in]   = the [out/t, in] shard of the global update;
- row:    B [out, r]   @ A [r, in/t] = the [out, in/t] shard.
So merging is local and exact. The update is computed in fp32 and rounded once into the base
weight's dtype.

merge(safe=True) checks, before touching the weight, that the update and the merged weight are
finite on every rank of the base's group (one 1-element all-reduce, so that all ranks take the
same decision); on failure the base is left bit-identical and ValueError is raised everywhere.
A second merge (or an unmerge of an unmerged adapter) is a no-op with a warning.

DoRA (adapter.magnitude set): merge writes W' = (m / n)[:, None] * (W + scale * B A) with
n = ||W + scale * B A||_row computed from the unmerged weight (row bases: the [out] all-reduce of
dora.weight_norm over the base's group) and kept for unmerge, which writes W'/(m / n) - scale B A.
The bias is left as it is (out = m / n * (W x + scale B A x) + bias, as in forward).
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist


@torch.no_grad()
def delta_weight(adapter) -> torch.Tensor:
    """scale * B @ A for this rank's shard, fp32, in the base weight's local shape."""
    a = adapter.lora_A.detach().float()
    b = adapter.lora_B.detach().float()
    # Either way round the product is the local shard; the layout only decides which factor is
    # the sharded one (column: B rows, row: A columns).
    return torch.matmul(b, a) * adapter.scaling


def all_ranks_agree(ok: bool, group, device) -> bool:
    """Whether `ok` holds on every rank of `group` (one 1-element all-reduce; local without one)."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return ok
    flag = torch.tensor([1.0 if ok else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item() > 0.5)


@torch.no_grad()
def merge(adapter, safe: bool = False) -> None:
    """Add the update into the base weight shard in place."""
    if adapter.merged:
        warnings.warn("LoraAdapter.merge: adapter is already merged; nothing to do", stacklevel=3)
        return
    if getattr(adapter.base_layer, "nf4", False):
        # The NF4 base's `weight` is a dequantised copy; an update written there would be lost.
        raise ValueError(
            "LoraAdapter.merge: the base layer is held in NF4 (--base-quantization nf4); merge "
            "onto the full-precision base instead (export hf --merge loads it)"
        )
    weight = adapter.base_layer.weight
    if weight is None:
        raise RuntimeError(
            "LoraAdapter.merge: the base layer owns no weight (an output layer whose weight is "
            "the tied word embedding, handed in at forward); merging would change the embedding"
        )
    delta = delta_weight(adapter)
    dora_scale = None
    if adapter.magnitude is not None:
        from megatron_lora.lora.dora import weight_norm

        norm = weight_norm(adapter)
        dora_scale = (adapter.magnitude.detach().float() / norm).unsqueeze(1)  # [out_local, 1]
        # merged - W, so that the fp32 and low-precision paths below add one tensor.
        delta = dora_scale * (weight.float() + delta) - weight.float()
        adapter._dora_merge_norm = norm
    if safe:
        merged = weight.float() + delta
        ok = bool(torch.isfinite(delta).all()) and bool(torch.isfinite(merged).all())
        if not all_ranks_agree(ok, adapter.geometry.tp_group, weight.device):
            raise ValueError(
                "LoraAdapter.safe_merge: the LoRA update or the merged weight has non-finite "
                "values on at least one rank; the base weight was left unchanged"
            )
    if weight.dtype == torch.float32:
        weight.add_(delta)
    else:
        # Low-precision weight: add in fp32 and round once.
        weight.copy_((weight.float() + delta).to(weight.dtype))
    adapter.merged = True


@torch.no_grad()
def unmerge(adapter) -> None:
    """Subtract the update from the base weight shard in place (the inverse of merge)."""
    if not adapter.merged:
        warnings.warn("LoraAdapter.unmerge: adapter is not merged; nothing to do", stacklevel=3)
        return
    weight = adapter.base_layer.weight
    if adapter.magnitude is not None:
        norm = adapter._dora_merge_norm
        dora_scale = (adapter.magnitude.detach().float() / norm).unsqueeze(1)
        weight.copy_((weight.float() / dora_scale - delta_weight(adapter)).to(weight.dtype))
        adapter._dora_merge_norm = None
    elif weight.dtype == torch.float32:
        weight.sub_(delta_weight(adapter))
    else:
        # Low-precision weight: subtract in fp32 and round once, as merge did.
        weight.copy_((weight.float() - delta_weight(adapter)).to(weight.dtype))
    adapter.merged = False


__all__ = ["all_ranks_agree", "delta_weight", "merge", "unmerge"]


class WeightDeltaMerge:
    """merge / unmerge / disable_adapters for an adapter whose whole update is one local fp32
    `delta_weight()` added to one weight (`_merge_target()`): router and embedding LoRA.
    `_check_mergeable()` may refuse a merge before anything changes."""

    def _merge_target(self) -> torch.Tensor:
        raise NotImplementedError

    def _check_mergeable(self) -> None:
        pass

    @torch.no_grad()
    def merge(self) -> None:
        self._check_mergeable()
        if self.merged:
            return
        w = self._merge_target()
        w.copy_((w.float() + self.delta_weight()).to(w.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if not self.merged:
            return
        w = self._merge_target()
        w.copy_((w.float() - self.delta_weight()).to(w.dtype))
        self.merged = False

    @contextlib.contextmanager
    def disable_adapters(self):
        """Within the context forward returns the base output alone."""
        previous, self._disabled = self._disabled, True
        try:
            yield self
        finally:
            self._disabled = previous
