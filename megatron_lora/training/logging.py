"""What a training run reports: Megatron-style log lines, TensorBoard scalars, a loss plot."""

from __future__ import annotations

import os
import sys
import time
from typing import List, Optional, Tuple


class TrainingLog:
    """Rank-0 reporting for a run. Other ranks get an instance that does nothing."""

    def __init__(self, enabled: bool, train_iters: int, tensorboard_dir: Optional[str],
                 start_iteration: int = 0):
        self.enabled = enabled
        self.train_iters = train_iters
        self.history: List[Tuple[int, float]] = []
        self._start = time.monotonic()
        self._last = self._start
        self._pending_iters, self._pending_tokens, self._excluded = 0, 0, 0.0
        self._writer = None
        self._bar = None
        if not enabled:
            return
        if tensorboard_dir:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(tensorboard_dir)
        if sys.stdout.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=train_iters, initial=start_iteration, unit="it",
                             dynamic_ncols=True, leave=False)

    def iteration(self, iteration: int, *, loss: float, lr: float, grad_norm: Optional[float],
                  tokens: int, consumed_samples: int, global_batch_size: int, log: bool) -> None:
        if not self.enabled:
            return
        self.history.append((iteration, loss))
        if self._writer is not None:
            self._writer.add_scalar("lm loss", loss, iteration)
            self._writer.add_scalar("learning-rate", lr, iteration)
            if grad_norm is not None:
                self._writer.add_scalar("grad-norm", grad_norm, iteration)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4f}")
        self._pending_iters += 1
        self._pending_tokens += tokens
        if log:
            now = time.monotonic()
            seconds = max(now - self._last - self._excluded, 1e-9)
            step_ms = seconds * 1000.0 / self._pending_iters
            tokens_per_s = self._pending_tokens / max(seconds, 1e-9)
            self._last, self._pending_iters, self._pending_tokens, self._excluded = now, 0, 0, 0.0
            gn = "nan" if grad_norm is None else f"{grad_norm:.3f}"
            line = (f" iteration {iteration:8d}/{self.train_iters:8d} | consumed samples: "
                    f"{consumed_samples:12d} | elapsed time per iteration (ms): {step_ms:.1f} | "
                    f"learning rate: {lr:.6E} | global batch size: {global_batch_size:5d} | "
                    f"lm loss: {loss:.6E} | grad norm: {gn} | "
                    f"tokens/s: {tokens_per_s:.0f} | "
                    f"elapsed: {now - self._start:.1f} s |")
            if self._bar is not None:
                self._bar.write(line)
            else:
                print(line, flush=True)

    def exclude(self, seconds: float) -> None:
        """Leave time spent outside training steps (a checkpoint save) out of the next line."""
        self._excluded += seconds

    def message(self, text: str) -> None:
        if self.enabled:
            (self._bar.write if self._bar is not None else print)(text)

    def close(self, plot_path: Optional[str]) -> Optional[str]:
        """Flush TensorBoard, draw the loss curve to `plot_path`; returns the plot's path."""
        if not self.enabled:
            return None
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.close()
        if plot_path and self.history:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            its, losses = zip(*self.history)
            fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
            ax.plot(its, losses, marker="." if len(its) < 50 else None)
            ax.set_xlabel("iteration")
            ax.set_ylabel("lm loss")
            ax.set_title("training loss")
            ax.grid(alpha=0.3)
            fig.tight_layout()
            os.makedirs(os.path.dirname(os.path.abspath(plot_path)), exist_ok=True)
            fig.savefig(plot_path)
            plt.close(fig)
            return plot_path
        return None
