"""The files of an adapter run folder, read as plain data (no model, no collective).

    SAVE/latest_checkpointed_iteration.txt     the tracker: the newest complete iteration
    SAVE/iter_0000020/                         a torch_dist checkpoint of the trainable tensors
        common                                 plain data: iteration, layout, run_metadata
                                               ({"lora": LoraConfig.to_dict(), ...}), scheduler
    SAVE/iter_0000020/run_config.yaml          the flags of the run that wrote it

Writing (and loading into a model) is training/checkpoint.py's; export, import and every command
that names an adapter read the folder through these functions, so the format lives below them
all. Every file is read through runtime.safe_load and must resolve inside its folder.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

from megatron_lora.runtime.folder_files import check_in_folder
from megatron_lora.runtime.safe_load import CheckpointFileError, load_common_state

TRACKER = "latest_checkpointed_iteration.txt"
RUN_CONFIG = "run_config.yaml"


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


class CheckpointError(ValueError):
    """A run folder whose checkpoint cannot be used as it is (a user error: the CLI exits 2)."""


def complete_iterations(root: str) -> List[int]:
    """Iterations of the complete (renamed into place) checkpoint folders in `root`."""
    found = []
    for name in os.listdir(root):
        digits = name[len("iter_"):]
        if name.startswith("iter_") and digits.isdigit() and os.path.isdir(os.path.join(root, name)):
            found.append(int(digits))
    return sorted(found)


def read_tracker(root: str) -> Optional[int]:
    """The iteration the tracker names (None when `root` has no tracker); CheckpointError when
    the tracker is not a number or names a folder that does not exist. The same on every rank
    (a shared file system), so it is safe before any collective."""
    path = os.path.join(root, TRACKER)
    if not os.path.lexists(path):
        return None
    check_in_folder(root, path, CheckpointError)  # a symlink out of the run folder is refused
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text!r}; write the "
                              f"number of a complete iter_XXXXXXX folder into it, or delete it "
                              f"to start training from scratch")
    iteration = int(text)
    if not os.path.isdir(iteration_dir(root, iteration)):
        present = complete_iterations(root)
        hint = (f"; or write one of the complete iterations here, {present}, into it"
                if present else " (there is no other complete iter_XXXXXXX folder here)")
        raise CheckpointError(
            f"{path} names iteration {iteration} but {iteration_dir(root, iteration)} does not "
            f"exist (moved or deleted?). Restore that folder{hint}; or delete {path} to start "
            f"training from scratch")
    return iteration


def resolve(path: str) -> str:
    """An iteration folder from either itself or a run folder with a tracker."""
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return path
    iteration = read_tracker(path)
    if iteration is None:
        raise FileNotFoundError(f"{path}: neither an adapter checkpoint (iter_*/ folder) nor a "
                                f"run folder with {TRACKER}")
    return iteration_dir(path, iteration)


def read_run_metadata(path: str) -> Dict:
    """The plain-data `common` section of an adapter checkpoint (no model needed, no collective):
    iteration, consumed_samples, layout, run_metadata (e.g. {"lora": LoraConfig.to_dict()})."""
    directory = resolve(path)
    file = os.path.join(directory, "common.pt")
    saved = load_common_state(directory)  # common.pt, or 0.19's in-checkpoint common_state
    if not isinstance(saved, dict) or not isinstance(saved.get("common"), dict):
        raise CheckpointFileError(file, "has no 'common' dict: not an adapter checkpoint")
    return saved["common"]


def read_scheduler_state(path: str) -> Dict:
    """The LR scheduler's saved state (megatron OptimizerParamScheduler.state_dict(): max_lr,
    min_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style, num_steps, weight decay fields) of a
    training checkpoint; plain data, no collective."""
    directory = resolve(path)
    saved = load_common_state(directory)
    if not isinstance(saved, dict) or not isinstance(saved.get("scheduler"), dict):
        raise CheckpointFileError(os.path.join(directory, "common.pt"),
                                  "has no 'scheduler' dict: not a training checkpoint")
    return saved["scheduler"]
