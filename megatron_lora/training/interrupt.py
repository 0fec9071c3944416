"""Ctrl-C during `train`: one line saying where the run stopped, exit status 130 on every rank.

A KeyboardInterrupt (SIGINT: Ctrl-C, or torchrun forwarding it to its workers) anywhere in a
rank's `train` becomes `TrainInterrupted`, which the CLI prints on rank 0 only:

    interrupted at iteration 7; last complete checkpoint: runs/lora/iter_0000005 (iteration 5);
    resume with the same command

(one line; N is the last iteration this run completed, M the iteration of the newest complete
checkpoint the tracker names, read from the file system). Nothing else is printed: the
interrupted step is simply lost, and a checkpoint half written at that moment stays an
`iter_*.tmp` folder that is never loaded.
"""

from __future__ import annotations

import signal
from typing import Optional


class TrainInterrupted(Exception):
    """A run stopped by SIGINT; str() is the line to print (module docstring)."""

    def __init__(self, iteration: int, save: Optional[str]):
        self.iteration, self.save = iteration, save
        super().__init__(interrupted_message(iteration, save))


class Progress:
    """The last iteration completed (train's on_iteration callback keeps it)."""

    def __init__(self, iteration: int = 0):
        self.iteration = iteration

    def __call__(self, iteration: int) -> None:
        self.iteration = iteration


def _last_checkpoint(save: Optional[str]):
    """(folder, iteration) of the newest complete checkpoint in `save`, or None."""
    if not save:
        return None
    from megatron_lora.training.checkpoint import iteration_dir, read_tracker

    try:
        iteration = read_tracker(save)
    except (OSError, ValueError):  # a tracker that cannot be used: there is no checkpoint to name
        return None
    return None if iteration is None else (iteration_dir(save, iteration), iteration)


def interrupted_message(iteration: int, save: Optional[str]) -> str:
    last = _last_checkpoint(save)
    if last is not None:
        return (f"interrupted at iteration {iteration}; last complete checkpoint: {last[0]} "
                f"(iteration {last[1]}); resume with the same command")
    where = f"in {save}" if save else "(no --save)"
    return (f"interrupted at iteration {iteration}; last complete checkpoint: none {where}; the "
            f"same command starts the run again")


_RECEIVED = False


def _on_sigint(signum, frame):
    global _RECEIVED
    _RECEIVED = True
    raise KeyboardInterrupt


def watch():
    """Remember that SIGINT came (then raise KeyboardInterrupt, as Python's own handler does):
    a rank blocked in a collective may instead see the error of a peer that has already
    stopped, and that error is then an interruption too (`received`). Returns the handler it
    replaced, for `unwatch` (None where none was replaced)."""
    global _RECEIVED
    _RECEIVED = False
    try:
        return signal.signal(signal.SIGINT, _on_sigint)
    except ValueError:  # not the main thread (an in-process caller): Python's handler stays
        return None


def unwatch(previous) -> None:
    """Put back the SIGINT handler `watch` replaced (a run that was not interrupted)."""
    if previous is not None and not _RECEIVED:
        signal.signal(signal.SIGINT, previous)


def received() -> bool:
    return _RECEIVED


def interrupted(progress: Progress, save: Optional[str]) -> TrainInterrupted:
    """The TrainInterrupted to raise for a KeyboardInterrupt; a second Ctrl-C while the rank
    winds down is ignored (it would print a traceback from wherever it lands)."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: nothing to change
        pass
    return TrainInterrupted(progress.iteration, save)
