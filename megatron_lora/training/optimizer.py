"""Megatron DDP, optimizer and LR scheduler over the trainable parameters only.

Frozen parameters (requires_grad=False) get no gradient buffer in megatron's DDP and no optimizer
state; expert parameters (`allreduce=False`) land in DDP's expert-data-parallel buffers.

Half-precision adapters (LoraConfig.dtype bf16 / fp16, train --lora-dtype): the parameters and
their DDP gradient buffers are in that dtype (gradients are reduced in it: 2 bytes each), and
megatron's Float16OptimizerWithFloat16Params keeps an fp32 master copy of each half parameter
(its Adam moments fp32 too): each step copies the half gradient into the fp32 master's
gradient, steps the master in fp32 and writes the master back rounded to the half dtype. fp16
adapters use megatron's dynamic loss scale (`config.grad_scale_func` scales the loss, the
optimizer unscales the gradients, starting at 2**16 and halving on an overflow); an overflow
skips the step, which the training loop reports as non-finite gradients. fp32 adapters (the
default) keep megatron's plain fp32 optimizer and fp32 gradient buffers, unchanged.

Without Transformer Engine or apex, megatron falls back to torch.optim.AdamW with torch's default
kernels (a Python loop over the parameters on CPU, foreach on CUDA) and to a gradient norm that
reads every tensor's norm on the host: the optimizer here is megatron's ChainedOptimizer with the
norm and clipping made by foreach kernels on the device (training/grad_norm.py), and its AdamW
runs torch's fused kernel on CUDA and its foreach kernels on CPU (`use_fast_adam`). With TE's or
apex's FusedAdam, megatron's choice stays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_lora import runtime
from megatron_lora.runtime.versions import filter_expert_duplicates_over_expert_tp
from megatron_lora.training.grad_norm import with_foreach_norm
from megatron_lora.training.step import finalize_pre_normalised_grads


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_style: str = "cosine"
    train_iters: int = 100
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    # Adapter optimizer state is small (2 fp32 moments per adapter parameter), so sharding it over
    # DP saves little; the non-distributed megatron optimizer keeps per-parameter state that
    # training/checkpoint.py saves in a layout-independent form. True opts into megatron's
    # distributed optimizer for runs that train without checkpoints.
    use_distributed_optimizer: bool = False
    # Resuming (training/resume.py, Megatron-LM's flags): take every LR scheduler setting from
    # this config (override) or from the checkpoint (use_checkpoint); neither: they must match
    # the checkpoint's except train_iters, the decay horizon, which is this config's.
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False

    def __post_init__(self):
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError("--override-opt_param-scheduler and "
                             "--use-checkpoint-opt_param-scheduler exclude each other")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr must be in [0, --lr {self.lr}], got {self.min_lr}")
        if self.lr_decay_style not in ("constant", "linear", "cosine", "inverse-square-root"):
            raise ValueError(f"--lr-decay-style must be constant, linear, cosine or "
                             f"inverse-square-root, got {self.lr_decay_style!r}")
        if self.train_iters < 1:
            raise ValueError(f"--train-iters must be >= 1, got {self.train_iters}")
        if not 0 <= self.lr_warmup_iters <= self.train_iters:
            raise ValueError(f"--lr-warmup-iters must be in [0, --train-iters {self.train_iters}],"
                             f" got {self.lr_warmup_iters}")
        if self.clip_grad < 0 or self.weight_decay < 0:
            raise ValueError(f"--clip-grad and --weight-decay must be >= 0, got {self.clip_grad} "
                             f"and {self.weight_decay}")


def trainable_precision(model_chunks) -> Tuple[bool, bool, bool]:
    """(fp16, bf16, half): the megatron OptimizerConfig precision flags for these chunks, and
    whether any trainable parameter is half. fp16 when the base config says so or an fp16
    parameter is trained (a loss scale is needed), else bf16 when the base config says so or a
    bf16 parameter is trained; megatron's Float16 optimizer then keeps fp32 masters for every
    half parameter and steps fp32 ones directly."""
    config = model_chunks[0].config
    dtypes = {p.dtype for m in model_chunks for p in m.parameters() if p.requires_grad}
    fp16 = bool(config.fp16) or torch.float16 in dtypes
    bf16 = (bool(config.bf16) or torch.bfloat16 in dtypes) and not fp16
    return fp16, bf16, bool(dtypes - {torch.float32})


def wrap_for_training(
    model_chunks: List[torch.nn.Module], optim: OptimConfig
) -> Tuple[List[DistributedDataParallel], object, OptimizerParamScheduler]:
    """DDP-wrap each chunk, build megatron's optimizer over trainable params and its scheduler."""
    config = model_chunks[0].config
    distributed = optim.use_distributed_optimizer
    if not any(p.requires_grad for m in model_chunks for p in m.parameters()):
        raise ValueError("the model has no trainable parameters")
    misplaced = [name for m in model_chunks for name in runtime.misplaced(m)]
    if misplaced:  # megatron's DDP would refuse them with the tensor's type name only
        raise RuntimeError(f"parameters not on this rank's device {runtime.device()}: "
                           f"{', '.join(misplaced[:8])}{' ...' if len(misplaced) > 8 else ''}")
    fp16, bf16, half = trainable_precision(model_chunks)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed,
        overlap_grad_reduce=False,
        # fp32 adapters: fp32 buffers (as before); half adapters: gradients in their own dtype.
        grad_reduce_in_fp32=not half,
    )
    # All chunks share the TransformerConfig; its finalize function does our DP/TP/PP reductions.
    config.finalize_model_grads_func = finalize_pre_normalised_grads
    wrapped = [DistributedDataParallel(config, ddp_config, m) for m in model_chunks]
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=bf16,
        fp16=fp16,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=distributed,
        **({"initial_loss_scale": 2.0 ** 16, "hysteresis": 1} if fp16 else {}),
    )
    optimizer = with_foreach_norm(get_megatron_optimizer(opt_config, wrapped))
    filter_expert_duplicates_over_expert_tp(optimizer)
    use_fast_adam(optimizer)
    if fp16:  # megatron's schedules multiply the loss by this before backward
        config.grad_scale_func = optimizer.scale_loss
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if optim.lr_warmup_iters else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.lr_warmup_iters,
        lr_decay_steps=optim.train_iters,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=optim.train_iters,
        wd_incr_style="constant",
    )
    return wrapped, optimizer, scheduler


def use_fast_adam(optimizer) -> None:
    """Make every torch Adam/AdamW that megatron built (its fallback without TE or apex) step all
    its parameters at once: torch's fused kernel when they are on CUDA, its foreach kernels
    otherwise. Set before any state exists (torch keeps a fused optimizer's step count on the
    parameter's device); TE's and apex's optimizers are left as they are."""
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        if any(inner.state.values()):
            raise RuntimeError("use_fast_adam: the optimizer has state already; call it first")
        cuda = all(p.is_cuda for g in inner.param_groups for p in g["params"])
        for group in [inner.defaults] + list(inner.param_groups):
            group["fused"], group["foreach"] = cuda, not cuda


def adam_step_tensor(inner: torch.optim.Optimizer, param: torch.Tensor,
                     step: float) -> torch.Tensor:
    """The tensor torch's Adam keeps as `param`'s step count: fp32 on the parameter's device for
    a fused (or capturable) group, whose kernel reads it there; a host scalar otherwise."""
    group = next(g for g in inner.param_groups if any(p is param for p in g["params"]))
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(float(step), dtype=torch.float32, device=param.device)
    return torch.tensor(float(step), device="cpu")


LOSS_SCALE_KEYS = ("scale", "growth_tracker", "hysteresis_tracker")


def _grad_scalers(optimizer) -> list:
    """The dynamic loss scalers of a megatron optimizer (one per sub-optimizer; none unless fp16)."""
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    return [s.grad_scaler for s in subs if getattr(s, "grad_scaler", None) is not None]


def loss_scale_state(optimizer) -> Optional[Dict[str, float]]:
    """fp16's dynamic loss scale as plain numbers ({"scale", "growth_tracker",
    "hysteresis_tracker"}, megatron's DynamicGradScaler.state_dict keys), or None without one.
    Every sub-optimizer's scaler sees the same all-reduced overflow flags, so one describes all."""
    scalers = _grad_scalers(optimizer)
    if not scalers:
        return None
    state = scalers[0].state_dict()
    return {"scale": float(state["scale"]), "growth_tracker": int(state["growth_tracker"]),
            "hysteresis_tracker": int(state["hysteresis_tracker"])}


def set_loss_scale_state(optimizer, state: Optional[Dict[str, float]]) -> None:
    """Restore what loss_scale_state returned into every scaler (a no-op without scalers or
    state). The scale tensor keeps its device and dtype (DynamicGradScaler.load_state_dict would
    move it to CUDA)."""
    if not state:
        return
    for scaler in _grad_scalers(optimizer):
        scaler._scale = torch.full_like(scaler.scale, float(state["scale"]))
        scaler._growth_tracker = int(state["growth_tracker"])
        scaler._hysteresis_tracker = int(state["hysteresis_tracker"])
