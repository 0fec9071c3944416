"""training/optimizer.py: megatron's torch AdamW fallback runs torch's foreach kernels on CPU
(fused on CUDA), updating exactly as megatron's own choice (torch's per-parameter loop on CPU);
the step count a checkpoint restores sits where torch's Adam keeps it."""

import pytest
import torch

from megatron_lora.runtime import ParallelLayout
from megatron_lora.training.optimizer import OptimConfig, adam_step_tensor, wrap_for_training
from tests.harness import multirank
from tests.training._support import many_tensors_module

U = 2.0 ** -24  # fp32 unit roundoff
LR = 1e-2


def _steps(optimizer, module, steps: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        for sub in optimizer.chained_optimizers:
            for p in sub.get_parameters():
                p.main_grad.copy_(torch.randn(p.shape, generator=g))
        ok, _, _ = optimizer.step()
        assert ok
    return torch.cat([p.detach().flatten() for p in module.parameters()])


@multirank(world_size=1, timeout=300)
def test_adam_runs_foreach_kernels_on_cpu_and_updates_as_megatrons_loop(layout=ParallelLayout()):
    optim = OptimConfig(lr=LR, lr_warmup_iters=0, lr_decay_style="constant", clip_grad=0.0)
    ours_module, theirs_module = many_tensors_module(40), many_tensors_module(40)
    _, ours, _ = wrap_for_training([ours_module], optim)
    _, theirs, _ = wrap_for_training([theirs_module], optim)
    inner = [s.optimizer for s in ours.chained_optimizers]
    assert len(inner) == 2 and all(isinstance(o, torch.optim.AdamW) for o in inner)
    assert all(g["foreach"] is True and g["fused"] is False for o in inner
               for g in o.param_groups), [(g["foreach"], g["fused"]) for o in inner
                                          for g in o.param_groups]
    for sub in theirs.chained_optimizers:  # megatron's own: torch's defaults (the loop on CPU)
        for group in sub.optimizer.param_groups:
            group["foreach"] = group["fused"] = None
    steps = 3
    a, b = _steps(ours, ours_module, steps), _steps(theirs, theirs_module, steps)
    # Both evaluate Adam's update lr * m_hat / (sqrt(v_hat) + eps) per element in fp32, maybe in
    # another order: at most ~8 roundings of an update bounded by lr (1 - b1) / sqrt(1 - b2)
    # (3.2 lr at 0.9 / 0.999), and one rounding of each new parameter, per step.
    bound = steps * U * (8 * 3.2 * LR + 2 * b.abs().max().item())
    worst = (a - b).abs().argmax().item()
    assert (a - b).abs().max().item() <= bound, (
        f"element {worst}: {a[worst].item()!r} vs {b[worst].item()!r}, bound {bound:.3g}")


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_a_restored_step_count_sits_where_torchs_adam_keeps_it(kernel):
    param = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.AdamW([param], lr=1e-3, **{kernel: True})
    param.grad = torch.ones(3)
    adam.step()
    made = adam.state[param]["step"]  # what torch made for this kernel
    restored = adam_step_tensor(adam, param, 7)
    assert (restored.device, restored.dtype) == (made.device, made.dtype)
    assert restored.item() == 7.0
    adam.state[param]["step"] = restored
    adam.step()  # the kernel takes it
    assert adam.state[param]["step"].item() == 8.0


@multirank(world_size=1, timeout=300)
def test_what_the_foreach_step_does_not_do_falls_back_to_megatrons_step(layout=ParallelLayout()):
    # Counting zeros (megatron's log_num_zeros_in_grad) is megatron's step's alone: with it on,
    # the step is megatron's (it reports the count) and its norm is the foreach one's.
    module = many_tensors_module(6)
    _, optimizer, _ = wrap_for_training([module], OptimConfig(clip_grad=1.0))
    optimizer.config.log_num_zeros_in_grad = True
    for sub in optimizer.chained_optimizers:
        for p in sub.get_parameters():
            p.main_grad.fill_(0.5)
            p.main_grad[0].zero_()  # one zero row of 8 per tensor
    ok, norm, zeros = optimizer.step()
    assert ok and zeros == 6 * 8, zeros
    # 6 tensors of 32 elements, 24 of them 0.5: the norm is sqrt(6 * 24 * 0.25) = 6 exactly.
    assert norm == pytest.approx(6.0, rel=4 * U), norm
