"""The gradient norm and clipping of a training step as a few foreach kernels on the device.

Without Transformer Engine or apex, megatron-core's `get_grad_norm_fp32` falls back to
`megatron.core.utils.local_multi_tensor_l2_norm`: one `torch.norm` per gradient, then
`torch.tensor(list of those norms)`, which reads each norm on the host (a stream synchronisation
per trainable tensor on a GPU), then one `.item()` per sub-optimizer for the all-reduced sum;
clipping then scales the gradients one tensor at a time (`local_multi_tensor_scale`). Here:

- each sub-optimizer's local sum of squares is `torch._foreach_norm` over its gradients, one
  `stack` and one norm, all on the device ([1] fp32, as megatron's);
- it is all-reduced (SUM) over the sub-optimizer's grad-stats group exactly as megatron does:
  one all-reduce over the shared group when every sub-optimizer has the same one, else one per
  sub-optimizer over its own (dense: tensor x pipeline model-parallel; experts: expert-TP x EP x
  pipeline; the distributed optimizer: its data-parallel instance group), so every rank makes the
  same collectives as under megatron's own step;
- the sums are added and square-rooted on the device, the clip factor
  min(1, clip_grad / (norm + 1e-6)) (megatron's) is applied by one `torch._foreach_mul_`;
- the norm is read on the host once, after the Adam step is queued.

`ForeachNormOptimizer` is megatron's ChainedOptimizer with `get_grad_norm` and `step` doing the
above; what megatron's step does besides (0.19's separately clipped grad-norm groups and
skip threshold, counting zeros, decoupled gradients) makes it fall back to megatron's own step.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.optimizer import ChainedOptimizer

from megatron_lora import runtime
from megatron_lora.runtime import versions

# megatron's clip_grad_by_total_norm_fp32: clip_coeff = max_norm / (total_norm + 1.0e-6)
CLIP_EPS = 1.0e-6


def local_square_norm(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of the squares of every element of `grads` (tensors on `device`): a [1] fp32 tensor on
    `device`, made by one foreach norm, one stack and one norm; no host read."""
    if not grads:
        return torch.zeros(1, dtype=torch.float32, device=device)
    norms = torch._foreach_norm(list(grads))
    return torch.linalg.vector_norm(torch.stack(norms).float()).square().reshape(1)


def reduced_norm(parts: Sequence[Tuple[Sequence[torch.Tensor], Optional[dist.ProcessGroup]]],
                 device: torch.device) -> torch.Tensor:
    """The global 2-norm of the gradients of `parts` [(grads, the group their sum of squares is
    all-reduced over)], a 0-dim fp32 tensor on `device`. Parts whose groups are all the same
    object are summed first and all-reduced once (megatron's shared-group case); else each part
    is all-reduced over its own group (megatron's per-sub-optimizer case)."""
    groups = [group for _, group in parts]
    shared = all(group is groups[0] for group in groups)
    if shared:
        total = sum((local_square_norm(grads, device) for grads, _ in parts),
                    torch.zeros(1, dtype=torch.float32, device=device))
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=groups[0] if groups else None)
    else:
        total = torch.zeros(1, dtype=torch.float32, device=device)
        for grads, group in parts:
            part = local_square_norm(grads, device)
            dist.all_reduce(part, op=dist.ReduceOp.SUM, group=group)
            total = total + part
    return total.sqrt().reshape(())


def clip_by_total_norm_(grads: List[torch.Tensor], max_norm: float,
                        total_norm: torch.Tensor) -> None:
    """Scale `grads` in place by megatron's clip factor max_norm / (total_norm + 1e-6) where it
    is below 1 (else leave them: a factor of exactly 1 changes no bit; a NaN norm clips nothing,
    as megatron's `clip_coeff < 1.0` test), with one foreach multiply and no host read."""
    if not grads:
        return
    coeff = max_norm / (total_norm + CLIP_EPS)
    coeff = torch.where(coeff < 1.0, coeff, torch.ones_like(coeff))
    torch._foreach_mul_(grads, coeff)


def _grads_to_clip(sub) -> List[torch.Tensor]:
    """The gradients megatron's ChainedOptimizer.step clips for a sub-optimizer: every parameter's
    `.grad` that is set (prepare_grads points them at the main gradients)."""
    return [p.grad for p in sub.get_parameters() if p.grad is not None]


class ForeachNormOptimizer(ChainedOptimizer):
    """megatron's ChainedOptimizer over the same sub-optimizers, its gradient norm and clipping
    made on the device by foreach kernels (module docstring); everything else is megatron's."""

    def _is_plain(self) -> bool:
        """True when megatron's step would do no more than norm, clip and step (decided once:
        the parameters and the config do not change)."""
        plain = getattr(self, "_plain", None)
        if plain is None:
            subs, config = self.chained_optimizers, self.config
            plain = self._plain = bool(
                subs and not config.log_num_zeros_in_grad
                and not config.use_precision_aware_optimizer_no_fp8_or_ds_fp8
                and versions.grad_norm_skip_threshold(config) == float("inf")
                and not any(versions.separate_grad_norm_groups(s) for s in subs))
        return plain

    def grad_norm_tensor(self) -> torch.Tensor:
        """The gradient norm megatron's get_grad_norm computes (after prepare_grads), as a 0-dim
        fp32 tensor on the rank's device, with no host read."""
        parts = [(versions.grads_for_norm(s), s.get_grad_stats_parallel_group())
                 for s in self.chained_optimizers]
        return reduced_norm(parts, runtime.device())

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        if not self._is_plain():
            return super().get_grad_norm()
        return self.grad_norm_tensor().item()

    @torch.no_grad()
    def step(self):
        """megatron's ChainedOptimizer.step: (update successful, grad norm as a float, number of
        zeros or None), its norm and clipping on the device and one host read of the norm."""
        if not self._is_plain():
            return super().step()
        if hasattr(self, "grad_norms_by_group"):
            self.grad_norms_by_group = {}  # 0.19's step resets it; no group is separate here
        if self.prepare_grads():
            return False, None, None
        norm = self.grad_norm_tensor()
        for sub in self.chained_optimizers:
            if getattr(sub, "is_stub_optimizer", False) or sub.config.clip_grad <= 0.0:
                continue
            clip_by_total_norm_(_grads_to_clip(sub), sub.config.clip_grad, norm)
        success = self.step_with_ready_grads()
        # Read after the update is queued: on a GPU the Adam kernels are already launched.
        return success, norm.item(), None


def with_foreach_norm(optimizer) -> ForeachNormOptimizer:
    """megatron's optimizer from get_megatron_optimizer (a ChainedOptimizer, or one
    sub-optimizer) as a ForeachNormOptimizer over the same sub-optimizers."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return ForeachNormOptimizer(list(subs))
