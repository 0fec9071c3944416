"""The training loop: global batches -> megatron schedule -> megatron optimizer -> checkpoints.

`train(...)` works on any model whose trainable parameters are marked `requires_grad` (for LoRA:
after apply_lora). The same run gives the same losses and the same trained parameters at any
parallel layout: batches are global and replicated, the loss is the mean over every target token
of the global batch, and gradients are summed over data-parallel ranks (training/step.py).

Device: each global batch is made on the host and crosses to the rank's device in one place
(`_on_device`). The losses stay on the device until a log line, a validation, a checkpoint or
the end, where the pending iterations' losses are read in one host read (`_Pending`): an
iteration reads nothing on the host but what megatron's optimizer reads (its gradient norm).
A non-finite loss or gradient norm stops the run (TrainingDiverged) at the first point it is
read: the gradient norm every iteration (when clipping), the loss at those reads.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_lora import runtime
from megatron_lora.data.batches import Batch, PackedDataset
from megatron_lora.training import checkpoint as ckpt
from megatron_lora.training import resume
from megatron_lora.training.flops import step_throughput
from megatron_lora.training.logging import (METRICS_FILE, PLOT_FILE, TrainingLog, WandbSettings,
                                            wandb_problems)
from megatron_lora.training.optimizer import OptimConfig, wrap_for_training
from megatron_lora.training.resume import ResumeMismatchError
from megatron_lora.training.step import forward_backward

__all__ = ["ResumeMismatchError", "RunConfig", "TrainResult", "TrainingDiverged", "train",
           "evaluate"]


class TrainingDiverged(FloatingPointError):
    """The loss or the gradient norm of an iteration is NaN or infinite (every rank raises it at
    the same point: both are the same on every rank). Nothing is saved after it."""

    def __init__(self, iteration: int, what: str, value: float, last_saved: Optional[str]):
        self.iteration = iteration
        saved = (f"the last checkpoint is {last_saved}" if last_saved else
                 "no checkpoint was saved")
        super().__init__(f"iteration {iteration}: the {what} is {value}; training stopped "
                         f"({saved}). Lower --lr, check the data, or train in fp32 to find "
                         f"the cause")


def _on_device(batch: Batch) -> Batch:
    """The one place a global batch crosses from the host to the rank's device."""
    return batch.to(runtime.device())


class _Pending:
    """Iterations trained since the last host read of their losses (device scalars)."""

    def __init__(self):
        self.items: List[tuple] = []

    def add(self, iteration: int, loss: torch.Tensor, **fields) -> None:
        self.items.append((iteration, loss, fields))

    def read(self) -> List[tuple]:
        """[(iteration, loss as a float, fields)], emptied; one host read for all of them."""
        if not self.items:
            return []
        values = torch.stack([loss.detach().float() for _, loss, _ in self.items]).tolist()
        out = [(it, value, fields) for (it, _, fields), value in zip(self.items, values)]
        self.items = []
        return out


@dataclass(frozen=True)
class RunConfig:
    micro_batch_size: int
    global_batch_size: int
    seq_length: int
    train_iters: int
    log_interval: int = 1
    save: Optional[str] = None
    save_interval: Optional[int] = None
    eval_interval: Optional[int] = None
    eval_iters: int = 1
    tensorboard_dir: Optional[str] = None
    seed: int = 1234
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None

    def __post_init__(self):
        for name in ("micro_batch_size", "global_batch_size", "seq_length", "train_iters",
                     "log_interval", "eval_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"global_batch_size={self.global_batch_size} is not a multiple of "
                             f"micro_batch_size={self.micro_batch_size}")
        if self.save_interval is not None and self.save_interval < 1:
            raise ValueError(f"save_interval must be >= 1, got {self.save_interval}")
        problems = wandb_problems(self.wandb_project, self.wandb_exp_name, self.wandb_save_dir)
        if problems:  # on every rank, before any collective (train's setup checks build this)
            raise ValueError("; ".join(problems))

    @property
    def output_dir(self) -> Optional[str]:
        """Where metrics.jsonl and loss_curve.png go: --save, else --tensorboard-dir."""
        return self.save or self.tensorboard_dir

    def wandb_settings(self, config: Optional[dict] = None) -> Optional[WandbSettings]:
        """W&B settings of the run (None without wandb_project); files go to wandb_save_dir,
        by default <save>/wandb."""
        if not self.wandb_project:
            return None
        folder = self.wandb_save_dir or (os.path.join(self.save, "wandb") if self.save else None)
        return WandbSettings(self.wandb_project, self.wandb_exp_name, folder, config)

    def batch_problems(self, data_parallel_size: int) -> List[str]:
        """Checked on every rank before training: no collective is needed to agree on it."""
        per = self.micro_batch_size * data_parallel_size
        if self.global_batch_size % per:
            return [f"global_batch_size={self.global_batch_size} is not divisible by "
                    f"micro_batch_size*data_parallel_size = {self.micro_batch_size}*"
                    f"{data_parallel_size} = {per}"]
        return []


@dataclass
class TrainResult:
    """losses: {iteration: loss} of the iterations this call trained; iteration: the last one
    (start_iteration when it trained none); start_iteration: the iteration it resumed at (0 for
    a fresh run), so it trained iterations start_iteration+1 .. iteration; validation_losses:
    {iteration: validation loss} of this call's evaluations (every rank has them)."""

    losses: Dict[int, float]
    iteration: int
    consumed_samples: int
    plot: Optional[str]
    checkpoint: Optional[str]
    start_iteration: int = 0
    validation_losses: Dict[int, float] = field(default_factory=dict)

    @property
    def trained_iterations(self) -> int:
        return self.iteration - self.start_iteration

    def describe(self) -> str:
        """e.g. "trained 10 iterations (41-50)", "trained 0 iterations (checkpoint at 40)"."""
        n = self.trained_iterations
        if n == 0:
            return f"trained 0 iterations (the checkpoint is at iteration {self.iteration})"
        span = f"{self.start_iteration + 1}-{self.iteration}" if n > 1 else f"{self.iteration}"
        return f"trained {n} iteration{'s' if n != 1 else ''} ({span})"


def train(
    model_chunks: List[torch.nn.Module],
    dataset: PackedDataset,
    run: RunConfig,
    optim: OptimConfig,
    *,
    layout_name: str,
    run_metadata: Optional[Dict] = None,
    load: Optional[str] = None,
    eval_dataset: Optional[PackedDataset] = None,
    stop_after: Optional[int] = None,
    on_iteration: Optional[Callable[[int], None]] = None,
    model_shape=None,
    lora_config=None,
) -> TrainResult:
    """Train for run.train_iters iterations (resuming from `load` or `run.save` if they hold a
    checkpoint). `run_metadata` (plain data, e.g. the LoRA config) is saved with checkpoints and
    must match on resume. `stop_after` ends the loop early at that iteration (as a crash would).
    `model_shape` (a ModelShape) and `lora_config` (None: full fine-tuning) make the log report
    model TFLOP/s (training/flops.py); without `model_shape` it reports tokens/s only.
    `on_iteration(iteration)` is called after each iteration's optimizer step. Raises
    TrainingDiverged on a non-finite loss or gradient norm (module docstring)."""
    problems = run.batch_problems(parallel_state.get_data_parallel_world_size())
    if problems:
        raise ValueError("; ".join(problems))
    wrapped, optimizer, scheduler = wrap_for_training(model_chunks, optim)
    iteration, consumed = 0, 0
    source = load or run.save
    notes: List[str] = []
    if source and ckpt.read_tracker(source) is not None:
        # Compared before any tensor is read (the same on every rank, no collective): a
        # checkpoint of another LoRA rank would otherwise fail deep inside the loader with a
        # shape error, and another LR schedule would be taken silently.
        saved_meta = ckpt.read_run_metadata(source).get("run_metadata")
        notes += resume.check_metadata(source, saved_meta, run_metadata)
        saved_sched = ckpt.read_scheduler_state(source)
        mode, sched_notes = resume.plan_scheduler(source, saved_sched, optim)
        notes += sched_notes
        resume.prepare(scheduler, mode)
        common = ckpt.load_checkpoint(source, wrapped, optimizer, scheduler, layout_name)
        iteration, consumed = int(common["iteration"]), int(common["consumed_samples"])
        notes += resume.after_load(scheduler, optimizer, mode, saved_sched, iteration,
                                   run.train_iters, source)
    start_iteration = iteration
    rank0 = dist.get_rank() == 0
    out_dir = run.output_dir
    flops, peak, flops_note = (step_throughput(model_chunks, model_shape, lora_config, run)
                               if model_shape is not None else (None, None, None))
    log = TrainingLog(rank0, run.train_iters, run.tensorboard_dir, start_iteration=iteration,
                      metrics_path=os.path.join(out_dir, METRICS_FILE) if out_dir else None,
                      wandb=run.wandb_settings(dict(asdict(run), run_metadata=run_metadata)),
                      step_flops=flops, devices=dist.get_world_size(), peak_tflops=peak)
    if flops_note:
        log.message(flops_note)
    if rank0 and iteration:
        log.message(f"resumed from {source} at iteration {iteration} "
                    f"({consumed} samples consumed)")
        for note in notes:
            log.message(f"notice: {note}")
        if iteration >= run.train_iters:
            log.message(f"notice: the checkpoint is at iteration {iteration}, --train-iters is "
                        f"{run.train_iters}: nothing to train (raise --train-iters to extend "
                        f"the run)")
    losses: Dict[int, float] = {}
    validation: Dict[int, float] = {}
    # A run resumed from its own --save folder already has its checkpoint of `iteration`.
    last_saved = None
    if iteration and source == run.save:
        last_saved = ckpt.iteration_dir(run.save, iteration)
    pending = _Pending()

    def read_pending(log_line: bool) -> None:
        """Read the pending losses (one host read), check them, record them (collective-free:
        every rank reads the same values)."""
        items = pending.read()
        for k, (it, value, fields) in enumerate(items):
            if not math.isfinite(value):
                raise TrainingDiverged(it, "loss", value, last_saved)
            losses[it] = value
            log.iteration(it, loss=value, log=log_line and k == len(items) - 1, **fields)

    while iteration < run.train_iters:
        host_batch = dataset.batch(consumed, run.global_batch_size)
        tokens = int(host_batch.loss_mask.sum())  # host memory: no device read
        batch = _on_device(host_batch)
        for chunk in wrapped:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        loss = forward_backward(wrapped, batch.tokens, batch.labels, batch.loss_mask,
                                batch.attention_mask, micro_batch_size=run.micro_batch_size,
                                iteration=iteration + 1)
        ok, grad_norm, _ = optimizer.step()  # megatron reads the gradient norm on the host
        if not ok:
            raise FloatingPointError(f"iteration {iteration + 1}: optimizer step skipped "
                                     f"(non-finite gradients, grad norm {grad_norm})")
        if grad_norm is not None and not math.isfinite(grad_norm):
            raise TrainingDiverged(iteration + 1, "gradient norm", grad_norm, last_saved)
        scheduler.step(increment=1)  # warmup and decay are counted in iterations
        iteration += 1
        consumed += run.global_batch_size
        pending.add(iteration, loss, lr=optimizer.param_groups[0]["lr"], grad_norm=grad_norm,
                    tokens=tokens, consumed_samples=consumed,
                    global_batch_size=run.global_batch_size)
        if on_iteration is not None:
            on_iteration(iteration)
        log_line = iteration % run.log_interval == 0 or iteration == run.train_iters
        evaluating = (eval_dataset is not None and run.eval_interval
                      and iteration % run.eval_interval == 0)
        saving = bool(run.save and run.save_interval and iteration % run.save_interval == 0)
        stopping = stop_after is not None and iteration >= stop_after
        if log_line or evaluating or saving or stopping:
            read_pending(log_line)
        if evaluating:
            validation[iteration] = evaluate(wrapped, eval_dataset, run)  # collective
            log.validation(iteration, validation[iteration])
        if saving:
            started = time.monotonic()
            last_saved = _save(run, iteration, consumed, wrapped, optimizer, scheduler,
                               layout_name, run_metadata)
            log.exclude(time.monotonic() - started)
        if stopping:
            break
    read_pending(False)  # none left unless the loop ended between reads
    finished = iteration == run.train_iters
    if run.save and finished and last_saved != ckpt.iteration_dir(run.save, iteration):
        last_saved = _save(run, iteration, consumed, wrapped, optimizer, scheduler,
                           layout_name, run_metadata)
    plot = log.close(os.path.join(out_dir, PLOT_FILE) if out_dir else None)
    return TrainResult(losses, iteration, consumed, plot, last_saved, start_iteration,
                       validation)


def _save(run, iteration, consumed, wrapped, optimizer, scheduler, layout_name, run_metadata):
    common = {
        "consumed_samples": consumed,
        "world_size": dist.get_world_size(),
        "layout": layout_name,
        "run_metadata": run_metadata,
        "run_config": asdict(run),
    }
    return ckpt.save_checkpoint(run.save, iteration, wrapped, optimizer, scheduler, common)


@torch.no_grad()
def evaluate(wrapped, dataset: PackedDataset, run: RunConfig) -> float:
    """Mean token loss over run.eval_iters global batches of `dataset` (from its start)."""
    total = torch.zeros((), dtype=torch.float32, device=runtime.device())
    for k in range(run.eval_iters):
        batch = _on_device(dataset.batch(k * run.global_batch_size, run.global_batch_size))
        total += forward_backward(wrapped, batch.tokens, batch.labels, batch.loss_mask,
                                  batch.attention_mask, micro_batch_size=run.micro_batch_size,
                                  forward_only=True)
    return float(total) / run.eval_iters  # one host read per evaluation
