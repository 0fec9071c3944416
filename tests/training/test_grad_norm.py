"""training/grad_norm.py: the step's gradient norm and clipping equal megatron-core's own
(`ChainedOptimizer.get_grad_norm` -> `get_grad_norm_fp32`, its duplicate filters and its
reductions over the dense and expert groups) at TP/PP/EP/ETP > 1, and the optimizer step reads the
device on the host a fixed number of times, whatever the number of trainable tensors."""

import math

import pytest
import torch
import torch.distributed as dist
from megatron.core.optimizer import ChainedOptimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

from megatron_lora import runtime
from megatron_lora.lora.model import LoraConfig, apply_lora
from megatron_lora.runtime import ParallelLayout, versions
from megatron_lora.testing.device_check import DeviceCheck
from megatron_lora.training.grad_norm import clip_by_total_norm_, local_square_norm, reduced_norm
from megatron_lora.training.optimizer import OptimConfig, wrap_for_training
from tests.harness import multirank
from tests.training import _support as S

U = 2.0 ** -24  # fp32 unit roundoff
LORA = LoraConfig(r=4, lora_alpha=8, seed=11,
                  target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])


def _random_grads(module, seed: int) -> int:
    """Fill every trainable parameter's main gradient (DDP's buffer) with normal values whose
    scale spans 1e-3..10 across tensors (sums of very unequal terms); returns the number of
    elements filled."""
    g = torch.Generator().manual_seed(seed)
    count = 0
    for p in module.parameters():
        if p.requires_grad:
            scale = 10.0 ** (4 * torch.rand((), generator=g).item() - 3)
            p.main_grad.copy_(torch.randn(p.main_grad.shape, generator=g) * scale)
            count += p.numel()
    return count


def _norm_bound(terms: int) -> float:
    """Relative bound on |ours - megatron's| for a 2-norm over `terms` fp32 squares.
    Both sum the same non-negative squares in fp32 in different orders (per-tensor norm kernels,
    the stack, the all-reduces, the final sum). A sum of N non-negative terms is within (N-1)u of
    the exact one at worst; with rounding errors independent and of mean zero it is within
    lambda*sqrt(N)*u with probability >= 1 - 2exp(-lambda^2/2) (Higham & Mary 2019, Thm 2.4):
    lambda = 6 (failure odds 3e-8). The two sums differ by at most twice that, and the square
    root halves a relative error: 6*sqrt(N)*u. Then at most 4 roundings of the results (fp32
    square root here; megatron's fp32 norm before squaring, its double sqrt and combination of
    the two sub-optimizers' norms): 4u."""
    return U * (6.0 * math.sqrt(terms) + 4.0)


LAYOUTS = [
    # TP2 x PP2 with EP2 and expert-TP 1: the expert optimizer reduces over expert-TP x EP x PP,
    # dense over TP x PP; replicated expert factors are duplicates over expert-TP only.
    pytest.param(ParallelLayout(tp=2, pp=2, ep=2, etp=1, sp=True), 4, False,
                 id="TP2xPP2xEP2xETP1"),
    # TP2 x DP2 with EP2 x ETP2.
    pytest.param(ParallelLayout(tp=2, ep=2, etp=2), 4, False, id="TP2xEP2xETP2"),
    # megatron's distributed optimizer: main-gradient shards, every sub-optimizer's statistics
    # reduced over the whole data-parallel instance (one shared group).
    pytest.param(ParallelLayout(tp=2, ep=2, etp=1), 4, True, id="TP2xEP2xETP1-distributed"),
]


@pytest.mark.parametrize("layout,world_size,distributed", LAYOUTS)
@multirank(world_size=lambda world_size, **_: world_size, timeout=300)
def test_the_norm_and_clip_equal_megatrons(layout, world_size, distributed):
    model = S.model(layout)  # linear_proj (TP-sharded), expert linear_fc2, norms (replicated)
    apply_lora(model, LORA, verbose=False)
    _, optimizer, _ = wrap_for_training(
        [model], OptimConfig(clip_grad=1.0, use_distributed_optimizer=distributed))
    subs = optimizer.chained_optimizers
    assert any(g["is_expert_parallel"] for s in subs for g in s.param_groups), "no expert params"
    assert any(not g["is_expert_parallel"] for s in subs for g in s.param_groups), "no dense"
    local = _random_grads(model, seed=100 + dist.get_rank())
    terms = torch.tensor([float(local)])
    dist.all_reduce(terms)  # every element of every rank: an upper bound of the summed squares
    optimizer.prepare_grads()  # main_grad -> grad, as the step does

    theirs = ChainedOptimizer(subs).get_grad_norm()  # megatron's own code on these grads
    ours = optimizer.grad_norm_tensor()
    bound = _norm_bound(int(terms.item()))
    rel = abs(ours.item() - theirs) / theirs
    assert rel <= bound, (f"rank {dist.get_rank()}: norm {ours.item()!r} vs megatron's "
                          f"{theirs!r}: relative {rel:.3g} > bound {bound:.3g}")

    # The test can fail: leave the expert sub-optimizer's sum of squares unreduced over its
    # expert group (each rank counts only its own experts) and the norm is far off.
    dense = [(versions.grads_for_norm(s), s.get_grad_stats_parallel_group()) for s in subs
             if not all(g["is_expert_parallel"] for g in s.param_groups)]
    experts = [versions.grads_for_norm(s) for s in subs
               if all(g["is_expert_parallel"] for g in s.param_groups)]
    unreduced = (reduced_norm(dense, runtime.device()).square()
                 + sum(local_square_norm(g, runtime.device()) for g in experts)).sqrt()
    assert abs(unreduced.item() - theirs) / theirs > 100 * bound, (unreduced.item(), theirs)

    # Clipping: megatron's clip_grad_by_total_norm_fp32 on a copy, ours in place, at a max norm
    # a tenth of the norm (so it clips). Each scaled element differs by the factors' relative
    # difference (the norms', within `bound`) plus one rounding of the product (u).
    params = [p for s in subs for p in s.get_parameters() if p.grad is not None]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for c, p in zip(copies, params):
        c.grad = p.grad.detach().clone()
    clip_grad_by_total_norm_fp32(copies, theirs / 10, theirs)
    clip_by_total_norm_([p.grad for p in params], theirs / 10, ours)
    worst, where = 0.0, None
    for k, (c, p) in enumerate(zip(copies, params)):
        diff = ((p.grad - c.grad).abs() / c.grad.abs().clamp_min(1e-30)).max().item()
        if diff > worst:
            worst, where = diff, k
    assert worst <= bound + U, (f"clipped gradient {where} ({tuple(params[where].shape)}): "
                                f"relative {worst:.3g} > {bound + U:.3g}")


def _reads_of_a_step(count: int, megatrons: bool) -> int:
    """Host reads of device values made by the second optimizer step (the first makes the Adam
    state) over `count` trainable tensors, ours or megatron's own step and Adam."""
    with DeviceCheck() as check:
        module = S.many_tensors_module(count)
        _, optimizer, _ = wrap_for_training([module], OptimConfig(clip_grad=1e-3))
        if megatrons:  # megatron's ChainedOptimizer over the same sub-optimizers
            optimizer = ChainedOptimizer(optimizer.chained_optimizers)
            for sub in optimizer.chained_optimizers:
                for group in sub.optimizer.param_groups:
                    group["fused"] = group["foreach"] = None  # torch's default kernels
        reads = []
        for _ in range(2):
            _random_grads(module, seed=count)
            before = len(check.reads)
            ok, norm, _ = optimizer.step()
            assert ok and math.isfinite(norm)
            reads.append(len(check.reads) - before)
    assert not check.errors, check.errors
    return reads[-1]


@multirank(world_size=1, timeout=300)
def test_a_step_reads_the_host_the_same_at_10_and_1000_tensors(layout=ParallelLayout()):
    ours = {count: _reads_of_a_step(count, megatrons=False) for count in (10, 1000)}
    # One read: the norm, after the update is queued.
    assert ours == {10: 1, 1000: 1}, ours
    # The count sees per-tensor reads: megatron's fallback reads each tensor's norm.
    theirs = {count: _reads_of_a_step(count, megatrons=True) for count in (10, 1000)}
    assert theirs[1000] - theirs[10] >= 990, theirs
