"""What a training run reports (rank 0): Megatron-style log lines, a metrics history file,
TensorBoard scalars, Weights & Biases, and a plot of the whole run.

Scalar names are Megatron-LM's, the same everywhere (TensorBoard tags, W&B keys, metrics.jsonl
keys): `lm loss`, `learning-rate`, `grad-norm` every iteration, `lm loss validation` at every
--eval-interval. A log line's `lm loss` is the mean of the iterations since the previous line
(Megatron-LM's; with --log-interval 1 the iteration's own), the metrics file and TensorBoard have
each iteration's. Each logged iteration (--log-interval) adds its throughput since the last
logged one: `tokens/s` (target tokens), and with the step's model FLOPs known (training/flops.py)
`tflops`, model TFLOP/s per device, and `mfu` where the device's peak is known.

The history of a run is `metrics.jsonl` in its output folder (--save, else --tensorboard-dir):
one JSON object per line, appended by rank 0 for each iteration (when its loss is read: at log
lines, evaluations and checkpoints, training/loop.py) and evaluation, each line
written whole and flushed to disk before training goes on. A resume first drops the records
after the iteration it resumes at (they are trained again) by replacing the file atomically,
then appends, so `loss_curve.png`, drawn from the file at the end of every run, covers the whole
run however often it was interrupted. A line torn by a crash is skipped when read.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss_curve.png"
LOSS, LR, GRAD_NORM, VALID_LOSS = "lm loss", "learning-rate", "grad-norm", "lm loss validation"
TOKENS_PER_S, TFLOPS, MFU = "tokens/s", "tflops", "mfu"


def wandb_problems(project: Optional[str], exp_name: Optional[str] = None,
                   save_dir: Optional[str] = None) -> List[str]:
    """Problems of the W&B settings, local to the calling rank (no collective): the wandb package
    missing when --wandb-project is given, or --wandb-exp-name / --wandb-save-dir without it.
    RunConfig calls it on construction, so `train` refuses these before megatron starts."""
    if not project:
        given = [flag for flag, value in (("--wandb-exp-name", exp_name),
                                          ("--wandb-save-dir", save_dir)) if value]
        return [f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --wandb-project"] \
            if given else []
    try:
        import wandb  # noqa: F401
    except ImportError:
        return ["--wandb-project needs the wandb package, which is not installed: "
                "pip install 'megatron-lora[wandb]' (or pip install wandb)"]
    return []


@dataclass(frozen=True)
class WandbSettings:
    """Where rank 0 logs to W&B: project, run name, folder (wandb writes into <dir>/wandb/)."""

    project: str
    name: Optional[str] = None
    dir: Optional[str] = None
    config: Optional[dict] = None


def _finite(x) -> Optional[float]:
    return None if x is None or not math.isfinite(float(x)) else float(x)


class MetricsFile:
    """The run's history, `metrics.jsonl` (see the module docstring)."""

    def __init__(self, path: str):
        self.path = path

    def start(self, resume_iteration: int) -> None:
        """Keep the records of iterations <= resume_iteration (none for a fresh run), atomically."""
        keep = [r for r in read_metrics(self.path) if r["iteration"] <= resume_iteration]
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{METRICS_FILE}.", dir=folder)
        try:
            with os.fdopen(fd, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in keep)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def append(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")  # one write of a whole line
            f.flush()
            os.fsync(f.fileno())


def read_metrics(path: str) -> List[dict]:
    """The records of a metrics.jsonl in order (a missing file: none). Lines that are not a JSON
    object with an integer `iteration` (a line torn by a crash) are skipped."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and type(record.get("iteration")) is int:
                records.append(record)
    return records


def run_series(records: List[dict]) -> Dict[str, Dict[int, float]]:
    """{scalar name: {iteration: value}} of the records (a later record of an iteration wins)."""
    series: Dict[str, Dict[int, float]] = {LOSS: {}, LR: {}, GRAD_NORM: {}, VALID_LOSS: {}}
    for r in records:
        for name, values in series.items():
            if r.get(name) is not None:
                values[r["iteration"]] = float(r[name])
    return {name: dict(sorted(v.items())) for name, v in series.items()}


def plot_run(records: List[dict], path: str) -> Optional[Dict[str, Dict[int, float]]]:
    """Draw the whole run to `path` (PNG): training loss, validation loss (markers) and the
    learning rate (second axis) over iterations. Returns the series drawn (None: nothing to draw)."""
    series = run_series(records)
    if not series[LOSS] and not series[VALID_LOSS]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    handles = []
    if series[LOSS]:
        its = list(series[LOSS])
        handles += ax.plot(its, list(series[LOSS].values()), color="tab:blue",
                           marker="." if len(its) < 50 else None, label="training loss")
    if series[VALID_LOSS]:
        handles += ax.plot(list(series[VALID_LOSS]), list(series[VALID_LOSS].values()),
                           linestyle="none", marker="o", color="tab:orange",
                           label="validation loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel(LOSS)
    ax.grid(alpha=0.3)
    if series[LR]:
        lr_ax = ax.twinx()
        handles += lr_ax.plot(list(series[LR]), list(series[LR].values()), color="tab:gray",
                              linestyle="--", linewidth=1, label="learning rate")
        lr_ax.set_ylabel(LR)
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    its = sorted(set(series[LOSS]) | set(series[VALID_LOSS]))
    ax.set_title(f"iterations {its[0]}-{its[-1]}")
    ax.legend(handles=handles, loc="upper right", fontsize="small")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return series


class TrainingLog:
    """Rank-0 reporting for a run. Other ranks get an instance that does nothing (enabled=False).

    tensorboard_dir: TensorBoard event files (tags exactly as named above; tensorboardX's
        add_scalar would rewrite `lm loss` as `lm_loss`, so summaries are written directly).
    metrics_path: the run's metrics.jsonl (None: no history file; the plot then shows this
        call's iterations only). start_iteration: the iteration the run resumes at.
    wandb: W&B settings (None: no W&B).
    step_flops: the model FLOPs of one iteration, every rank together (training/flops.py; None:
        no TFLOP/s). devices: how many devices share them (TFLOP/s is per device, as Megatron-LM
        reports throughput per GPU). peak_tflops: one device's peak (None: no MFU).
    """

    def __init__(self, enabled: bool, train_iters: int, tensorboard_dir: Optional[str],
                 start_iteration: int = 0, *, metrics_path: Optional[str] = None,
                 wandb: Optional[WandbSettings] = None, step_flops: Optional[float] = None,
                 devices: int = 1, peak_tflops: Optional[float] = None):
        self.enabled = enabled
        self.train_iters = train_iters
        self.step_flops, self.devices, self.peak_tflops = step_flops, devices, peak_tflops
        self.history: List[dict] = []  # this call's records
        self._start = time.monotonic()
        self._last = self._start
        self._pending_iters, self._pending_tokens, self._excluded = 0, 0, 0.0
        self._pending_loss = 0.0
        self._tb = None
        self._wandb = None
        self._bar = None
        self._metrics = None
        if not enabled:
            return
        if metrics_path:
            self._metrics = MetricsFile(metrics_path)
            self._metrics.start(start_iteration)
        if tensorboard_dir:
            from tensorboardX import FileWriter

            self._tb = FileWriter(tensorboard_dir)
        if wandb is not None:
            self._wandb = _start_wandb(wandb)
        if sys.stdout.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=train_iters, initial=start_iteration, unit="it",
                             dynamic_ncols=True, leave=False)

    def _record(self, iteration: int, scalars: Dict[str, Optional[float]], **extra) -> None:
        record = {"iteration": iteration, **extra, **{k: _finite(v) for k, v in scalars.items()}}
        self.history.append(record)
        if self._metrics is not None:
            self._metrics.append(record)
        shown = {k: v for k, v in scalars.items() if v is not None}
        if self._tb is not None:
            from tensorboardX.proto.summary_pb2 import Summary

            self._tb.add_summary(Summary(value=[Summary.Value(tag=k, simple_value=float(v))
                                                for k, v in shown.items()]), global_step=iteration)
        if self._wandb is not None:
            self._wandb.log({k: float(v) for k, v in shown.items()}, step=iteration)

    def iteration(self, iteration: int, *, loss: float, lr: float, grad_norm: Optional[float],
                  tokens: int, consumed_samples: int, global_batch_size: int, log: bool) -> None:
        if not self.enabled:
            return
        self._pending_iters += 1
        self._pending_tokens += tokens
        self._pending_loss += loss
        scalars = {LOSS: loss, LR: lr, GRAD_NORM: grad_norm}
        shown_loss = self._pending_loss / self._pending_iters  # Megatron-LM's: the line's mean
        if log:
            now = time.monotonic()
            seconds = max(now - self._last - self._excluded, 1e-9)
            step_ms = seconds * 1000.0 / self._pending_iters
            throughput = self._throughput(seconds)
            scalars.update(throughput)
            self._last, self._pending_iters, self._pending_tokens, self._excluded = now, 0, 0, 0.0
            self._pending_loss = 0.0
        self._record(iteration, scalars, **{"consumed samples": consumed_samples})
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4f}")
        if log:
            gn = "nan" if grad_norm is None else f"{grad_norm:.3f}"
            self.message(
                f" iteration {iteration:8d}/{self.train_iters:8d} | consumed samples: "
                f"{consumed_samples:12d} | elapsed time per iteration (ms): {step_ms:.1f} | "
                f"learning rate: {lr:.6E} | global batch size: {global_batch_size:5d} | "
                f"lm loss: {shown_loss:.6E} | grad norm: {gn} | "
                f"tokens/s: {throughput[TOKENS_PER_S]:.0f} | {_shown_flops(throughput)}"
                f"elapsed: {now - self._start:.1f} s |")

    def _throughput(self, seconds: float) -> Dict[str, float]:
        """tokens/s, and tflops (per device) and mfu when known, over the pending iterations."""
        out = {TOKENS_PER_S: self._pending_tokens / seconds}
        if self.step_flops is not None:
            out[TFLOPS] = self.step_flops * self._pending_iters / seconds / self.devices / 1e12
            if self.peak_tflops:
                out[MFU] = out[TFLOPS] / self.peak_tflops
        return out

    def validation(self, iteration: int, loss: float) -> None:
        """The validation loss after `iteration` (mean over --eval-iters batches)."""
        if not self.enabled:
            return
        self._record(iteration, {VALID_LOSS: loss})
        self.message(f" validation at iteration {iteration} | lm loss: {loss:.6E}")

    def exclude(self, seconds: float) -> None:
        """Leave time spent outside training steps (a checkpoint save) out of the next line."""
        self._excluded += seconds

    def message(self, text: str) -> None:
        if self.enabled:
            if self._bar is not None:
                self._bar.write(text)
            else:
                print(text, flush=True)

    def close(self, plot_path: Optional[str]) -> Optional[str]:
        """Flush TensorBoard, finish the W&B run, draw the whole run (the metrics file, else this
        call's records) to `plot_path`; returns the plot's path (None: nothing drawn)."""
        if not self.enabled:
            return None
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if not plot_path:
            return None
        records = read_metrics(self._metrics.path) if self._metrics is not None else self.history
        return plot_path if plot_run(records, plot_path) is not None else None


def _shown_flops(throughput: Dict[str, float]) -> str:
    if TFLOPS not in throughput:
        return ""
    mfu = f"MFU: {throughput[MFU] * 100:.1f}% | " if MFU in throughput else ""
    return f"TFLOP/s per device: {throughput[TFLOPS]:.3g} | {mfu}"


def _start_wandb(settings: WandbSettings):
    import wandb

    if settings.dir:
        os.makedirs(settings.dir, exist_ok=True)
    return wandb.init(project=settings.project, name=settings.name, dir=settings.dir,
                      config=settings.config)
