"""What a resume accepts: the run metadata it compares and the LR schedule it continues.

Run metadata (the LoRA config and the model's shape, saved with every checkpoint) must match
except for the fields in ACCEPTED_METADATA: a mismatch names each differing field with the flag
that sets it. The LR scheduler (megatron's OptimizerParamScheduler) follows Megatron-LM's two
flags:

- neither flag: the scheduler settings of the command line must equal the checkpoint's, except
  the decay horizon (`--train-iters`), which is this run's: a run extended from 40 to 50
  iterations continues its decay over 50 iterations from step 40 (a notice gives the LR);
- `--override-opt_param-scheduler`: every scheduler setting from the command line;
- `--use-checkpoint-opt_param-scheduler`: every scheduler setting from the checkpoint.

The step count always comes from the checkpoint. A schedule that would train any remaining
iteration at learning rate 0 is refused, naming the flags (never a silent zero LR). Everything
here is computed from plain data the same way on every rank (no collective).
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Tuple

# Metadata fields (dotted paths) a resume may change: the adapters' initialisation seed (the
# factors come from the checkpoint) and the dropout probability (a training-time setting with no
# parameter behind it).
ACCEPTED_METADATA = ("lora.seed", "lora.lora_dropout")
# Fields a checkpoint may lack (written by a version that did not record them): accepted then.
UNRECORDED_ACCEPTED = ("lora.dtype",)
# Records a checkpoint may lack, not compared then: the base model's (lora/adapter_base.py; the
# top-level vocab_size, hidden_size, num_layers and num_experts are compared for every checkpoint).
UNRECORDED_PREFIXES = ("base.",)

# Top-level metadata entries never compared: the record of the flags of the run that wrote a
# checkpoint (its run_config.yaml); what a resume may change is decided by the fields above.
NOT_COMPARED = ("run_config",)

# Dotted metadata path -> the train flag that sets it (for messages).
METADATA_FLAGS = {
    "lora.r": "--lora-rank", "lora.lora_alpha": "--lora-alpha",
    "lora.target_modules": "--lora-target-modules", "lora.use_rslora": "--lora-use-rslora",
    "lora.use_dora": "--lora-use-dora", "lora.dtype": "--lora-dtype",
    "lora.rank_pattern": "--lora-rank-pattern", "lora.alpha_pattern": "--lora-alpha-pattern",
    "lora.lora_dropout": "--lora-dropout",
    "lora.seed": "--seed", "lora.trainable_token_indices": "--add-special-tokens",
    "lora.num_virtual_tokens": "--peft-type prefix --num-virtual-tokens",
    "lora.prefix_projection": "--prefix-projection",
    "lora.encoder_hidden_size": "--prefix-encoder-hidden-size",
    "vocab_size": "--load/--load-hf", "hidden_size": "--load/--load-hf",
    "num_layers": "--load/--load-hf", "num_experts": "--load/--load-hf",
}

# OptimizerParamScheduler state key -> (OptimConfig field, train flag).
SCHEDULER_FIELDS = {
    "max_lr": ("lr", "--lr"),
    "min_lr": ("min_lr", "--min-lr"),
    "lr_warmup_steps": ("lr_warmup_iters", "--lr-warmup-iters"),
    "lr_decay_steps": ("train_iters", "--train-iters"),
    "lr_decay_style": ("lr_decay_style", "--lr-decay-style"),
    "start_wd": ("weight_decay", "--weight-decay"),
    "end_wd": ("weight_decay", "--weight-decay"),
    "wd_incr_steps": ("train_iters", "--train-iters"),
}
OVERRIDE_FLAG = "--override-opt_param-scheduler"
CHECKPOINT_FLAG = "--use-checkpoint-opt_param-scheduler"


class ResumeMismatchError(ValueError):
    """A checkpoint that does not belong to this run's configuration (e.g. another LoRA rank)."""


def _flatten(value, prefix: str = "") -> Dict[str, object]:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            # A dict of LoRA patterns is compared as one value (its keys are regexes).
            if isinstance(v, dict) and not path.endswith("_pattern"):
                out.update(_flatten(v, path))
            else:
                out[path] = v
        return out
    return {prefix: value}


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True)


Difference = Tuple[str, object, object]


def metadata_differences(saved: Optional[Dict], current: Optional[Dict]
                         ) -> Tuple[List[Difference], List[Difference]]:
    """(refused, accepted): (dotted field, checkpoint value, this run's value) for every field of
    the run metadata that differs; `accepted` holds those in ACCEPTED_METADATA."""
    a, b = (_flatten({k: v for k, v in (d or {}).items() if k not in NOT_COMPARED})
            for d in (saved, current))
    missing = object()
    refused, accepted = [], []
    for path in sorted(set(a) | set(b)):
        old, new = a.get(path, missing), b.get(path, missing)
        if old is not missing and new is not missing and _canonical(old) == _canonical(new):
            continue
        if old is missing and path.startswith(UNRECORDED_PREFIXES):
            continue  # a checkpoint written before the record: nothing to compare
        # Checkpoints written before --lora-dtype record none: their adapters load into this
        # run's dtype (the values are converted on load).
        unrecorded = path in UNRECORDED_ACCEPTED and (old is missing or old is None)
        old = "(absent)" if old is missing else old
        new = "(absent)" if new is missing else new
        (accepted if path in ACCEPTED_METADATA or unrecorded else refused).append((path, old, new))
    return refused, accepted


def _field(path: str, old, new) -> str:
    """e.g. "lora 'r': 4 in the checkpoint, 8 in this run (--lora-rank)"."""
    flag = METADATA_FLAGS.get(path)
    *parents, name = path.split(".")
    where = " ".join(parents) + " " if parents else ""
    return (f"{where}{name!r}: {old!r} in the checkpoint, {new!r} in this run"
            + (f" ({flag})" if flag else ""))


def check_metadata(source: str, saved: Optional[Dict], current: Optional[Dict]) -> List[str]:
    """Raise ResumeMismatchError naming the refused differences; returns notices for the
    accepted ones."""
    refused, accepted = metadata_differences(saved, current)
    if refused:
        parts = "; ".join(_field(p, old, new) for p, old, new in refused)
        raise ResumeMismatchError(
            f"cannot resume from {source}: it was written with other settings: {parts}. A "
            f"resume may change --seed, --lora-dropout, the LR schedule (see "
            f"{OVERRIDE_FLAG}) and the flags not saved with a checkpoint (layout, batch, data, "
            f"logging; docs/training.md, Checkpoints); start a new run in another --save folder "
            f"to change these")
    return [f"accepted on resume: {_field(p, old, new)}" +
            (" (the adapters come from the checkpoint; the data order and the dropout masks "
             "follow this run's --seed)" if p == "lora.seed" else
             " (applies from the next iteration)")
            for p, old, new in accepted]


def _differences(saved: Dict, optim) -> List[Tuple[str, str, object, object]]:
    """(state key, flag, checkpoint value, command-line value) of the scheduler settings that
    differ."""
    out = []
    for key, (attr, flag) in SCHEDULER_FIELDS.items():
        if key in saved and saved[key] != getattr(optim, attr):
            out.append((key, flag, saved[key], getattr(optim, attr)))
    return out


def _describe(diffs, exclude=()) -> str:
    seen, parts = set(), []
    for _, flag, old, new in diffs:
        if flag in seen or flag in exclude:
            continue
        seen.add(flag)
        parts.append(f"{flag} {new} (checkpoint: {old})")
    return ", ".join(parts)


def plan_scheduler(source: str, saved: Dict, optim) -> Tuple[str, List[str]]:
    """The resume mode ("override" or "checkpoint") megatron's scheduler loads with, and notices.

    Raises ResumeMismatchError when neither flag is given and settings other than --train-iters
    differ from the checkpoint's."""
    diffs = _differences(saved, optim)
    if optim.use_checkpoint_opt_param_scheduler:
        notes = [f"{CHECKPOINT_FLAG}: LR schedule from the checkpoint, ignoring "
                 f"{_describe(diffs)}"] if diffs else []
        return "checkpoint", notes
    if optim.override_opt_param_scheduler:
        notes = [f"{OVERRIDE_FLAG}: LR schedule from the command line: "
                 f"{_describe(diffs)}"] if diffs else []
        return "override", notes
    others = [d for d in diffs if d[1] != "--train-iters"]
    if others:
        raise ResumeMismatchError(
            f"cannot resume from {source}: the LR schedule settings differ from the "
            f"checkpoint's: {_describe(others)}. Pass {OVERRIDE_FLAG} to use this command "
            f"line's settings or {CHECKPOINT_FLAG} to keep the checkpoint's (Megatron-LM's flags)")
    notes = []
    if diffs:
        notes.append(f"the LR schedule decays over --train-iters {optim.train_iters} now (the "
                     f"checkpoint's over {saved['lr_decay_steps']}); {CHECKPOINT_FLAG} keeps the "
                     f"checkpoint's schedule, {OVERRIDE_FLAG} takes every scheduler setting from "
                     f"the command line")
    return "override", notes  # the settings are equal but the horizon: the command line's


def prepare(scheduler, mode: str) -> None:
    """Set megatron's scheduler to load the checkpoint state in `mode` (before load_state_dict)."""
    scheduler.override_opt_param_scheduler = mode == "override"
    scheduler.use_checkpoint_opt_param_scheduler = mode == "checkpoint"


def _lr_at(scheduler, group, step: int) -> float:
    saved = scheduler.num_steps
    scheduler.num_steps = step
    try:
        return float(scheduler.get_lr(group))
    finally:
        scheduler.num_steps = saved


def after_load(scheduler, optimizer, mode: str, saved: Dict, iteration: int, train_iters: int,
               source: str) -> List[str]:
    """Finish loading (the checkpoint's LR bounds into the param groups in "checkpoint" mode:
    megatron's groups carry max_lr/min_lr, which take precedence over the scheduler's) and check
    the LR of the iterations left. Returns notices; raises ResumeMismatchError on a zero LR."""
    if mode == "checkpoint":
        for group in optimizer.param_groups:
            for key in ("max_lr", "min_lr"):
                if key in group and key in saved:
                    group[key] = saved[key]
        scheduler.step(increment=0)  # re-derive every group's lr from the loaded state
    if iteration >= train_iters:
        return []
    group = optimizer.param_groups[0]
    # The LR of iteration k + 1 is the schedule at step k (the scheduler steps after each update).
    lrs = {k + 1: _lr_at(scheduler, group, k) for k in range(iteration, train_iters)}
    zero = [k for k, lr in lrs.items() if not lr > 0]
    if zero:
        how = (f"the checkpoint's schedule ({CHECKPOINT_FLAG}) ends at step "
               f"{scheduler.lr_decay_steps} with --min-lr {scheduler.min_lr}"
               if mode == "checkpoint" else
               f"--min-lr {scheduler.min_lr} with --train-iters {train_iters}")
        raise ResumeMismatchError(
            f"resuming from {source} at iteration {iteration}: iterations {zero[0]}-{zero[-1]} "
            f"would train at learning rate 0 ({how}). Drop {CHECKPOINT_FLAG} to decay over this "
            f"run's --train-iters, or pass {OVERRIDE_FLAG} with the --lr/--min-lr/--train-iters "
            f"to continue with")
    first, last = iteration + 1, train_iters
    return [f"LR schedule on resume: {lrs[first]:.4g} at iteration {first}, {lrs[last]:.4g} at "
            f"iteration {last} (max {scheduler.max_lr:.4g}, min {scheduler.min_lr:.4g}, "
            f"{scheduler.lr_decay_style} over {scheduler.lr_decay_steps} steps)"]
