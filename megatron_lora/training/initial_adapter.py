"""`train --adapter DIR`: a run's initial adapter weights (Megatron-LM's `--finetune` semantics).

DIR is one of:
- an adapter checkpoint of ours: a run folder (with latest_checkpointed_iteration.txt: its newest
  checkpoint), an `iter_XXXXXXX` folder, or the output of `import peft`;
- a Hugging Face PEFT LoRA folder (adapter_config.json): imported on the fly with
  `export.from_peft.import_peft` into a temporary folder of each rank (no shared file system is
  assumed and no collective is needed; the folder is removed once the weights are loaded).

Only the adapter weights are taken: the optimizer starts fresh (Adam moments zero, step 1), the
LR schedule and the iteration count start at 0, the data from its first sample. The LoRA
configuration (rank, alpha, targets, rsLoRA, DoRA, dtype, rank and alpha patterns) is the adapter's
(an adapter that records no dtype, e.g. a PEFT import, takes this run's --lora-dtype); a
--lora-* flag given with another value is an error naming the flag (TrainSetupError), while
--lora-dropout and --seed are this run's (no parameter behind them).

When --save already holds a checkpoint, the run resumes it (as Megatron-LM resumes from its
checkpoint; --finetune applies only when a run starts): DIR is not read at all (it may be gone),
and the LoRA configuration comes from that checkpoint, with the same rule for --lora-* flags.

Everything here runs on every rank before the first collective and reads files only.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import List, Optional

PEFT_CONFIG = "adapter_config.json"

# (argparse dest, flag, LoraConfig field): the settings an adapter brings with it.
ADAPTER_SETTINGS = (
    ("lora_rank", "--lora-rank", "r"),
    ("lora_alpha", "--lora-alpha", "lora_alpha"),
    ("lora_target_modules", "--lora-target-modules", "target_modules"),
    ("lora_use_rslora", "--lora-use-rslora", "use_rslora"),
    ("lora_use_dora", "--lora-use-dora", "use_dora"),
    ("lora_dtype", "--lora-dtype", "dtype"),
    ("lora_rank_pattern", "--lora-rank-pattern", "rank_pattern"),
    ("lora_alpha_pattern", "--lora-alpha-pattern", "alpha_pattern"),
    ("num_virtual_tokens", "--num-virtual-tokens", "num_virtual_tokens"),
    ("prefix_projection", "--prefix-projection", "prefix_projection"),
)


class AdapterSourceError(ValueError):
    """--adapter names something that cannot start a run (the message names the flag)."""


@dataclass
class InitialAdapter:
    """source: what --adapter named; directory: the adapter checkpoint to load (None when the run
    resumes --save instead); lora: the run's LoraConfig; imported: the report of an on-the-fly
    PEFT import; notes: lines for rank 0 to print; temp: a folder to remove after loading."""

    source: str
    directory: Optional[str]
    lora: object
    imported: Optional[dict] = None
    notes: List[str] = dataclasses.field(default_factory=list)
    temp: Optional[str] = None

    def cleanup(self) -> None:
        if self.temp is not None:
            shutil.rmtree(self.temp, ignore_errors=True)
            self.temp = None


def _lora_value(dest: str, value):
    """An argparse value as the LoraConfig field it sets (targets normalized, patterns as dicts)."""
    from megatron_lora.lora.targets import normalize_targets

    if dest == "lora_target_modules":
        return tuple(normalize_targets(value))
    if dest in ("lora_rank_pattern", "lora_alpha_pattern"):
        return dict(value or [])
    if dest == "lora_alpha":
        return float(value)
    if dest == "num_virtual_tokens":  # not given: no prefix, as a LoRA adapter records it
        return value or 0
    if dest == "prefix_projection":
        return bool(value)
    if dest == "lora_dtype":
        from megatron_lora.lora.model import lora_dtype

        return lora_dtype(value or "fp32")
    return value


def _shown(dest: str, value) -> str:
    if dest in ("lora_target_modules",):
        return " ".join(value)
    if dest in ("lora_rank_pattern", "lora_alpha_pattern"):
        return " ".join(f"{k}={v}" for k, v in dict(value).items()) or "(none)"
    if dest == "lora_dtype" and not isinstance(value, str):
        from megatron_lora.lora.model import dtype_name

        return str(dtype_name(value))
    return str(value)


def flag_conflicts(args, lora, given, owner: str = "the adapter's") -> List[str]:
    """"--lora-rank 8 (the adapter's: 4)" for every given --lora-* flag whose value differs from
    LoraConfig `lora`. given: the dests given on the command line or in --config (None: all)."""
    out = []
    for dest, flag, field in ADAPTER_SETTINGS:
        if given is not None and dest not in given:
            continue
        mine = _lora_value(dest, getattr(args, dest, None))
        theirs = getattr(lora, field)
        if field == "dtype" and theirs is None:  # not recorded (older adapters): this run's
            continue
        theirs = tuple(theirs) if field == "target_modules" else theirs
        same = (sorted(mine) == sorted(theirs) if field == "target_modules" else mine == theirs)
        if not same:
            out.append(f"{flag} {_shown(dest, getattr(args, dest, None))} ({owner}: "
                       f"{_shown(dest, theirs)})")
    return out


def set_lora_flags(args, lora) -> None:
    """Write LoraConfig `lora`'s settings into args (the run's resolved configuration records
    what is used)."""
    args.lora_rank = lora.r
    args.lora_alpha = float(lora.lora_alpha)
    args.lora_target_modules = list(lora.target_modules)
    args.lora_use_rslora = bool(lora.use_rslora)
    args.lora_use_dora = bool(lora.use_dora)
    if lora.dtype is not None:
        from megatron_lora.lora.model import dtype_name

        args.lora_dtype = dtype_name(lora.dtype)
    args.lora_rank_pattern = list(lora.rank_pattern.items())
    args.lora_alpha_pattern = list(lora.alpha_pattern.items())
    args.peft_type = "prefix" if lora.num_virtual_tokens else "lora"
    args.num_virtual_tokens = lora.num_virtual_tokens or None
    args.prefix_projection = bool(lora.prefix_projection)
    args.prefix_encoder_hidden_size = lora.encoder_hidden_size


def _base_config_path(args) -> str:
    """The base model's config.json for a PEFT import (what `import peft --load-hf` reads)."""
    if args.load_hf:
        return args.load_hf
    from megatron_lora.convert.hf_to_mcore import HF_CONFIG

    return args.hf_config or os.path.join(args.load, HF_CONFIG)


def _checkpoint_config(path: str, info, allow_other_base: bool = False):
    """(LoraConfig, iteration folder) of an adapter checkpoint of ours, every factor's shape
    checked against the model (export.adapter_ckpt.AdapterCheckpoint)."""
    from megatron_lora.export.adapter_ckpt import AdapterCheckpoint

    ckpt = AdapterCheckpoint(path, info, allow_other_base)
    return ckpt.config, ckpt.directory


def open_initial_adapter(args, info, resume_iteration: Optional[int]) -> InitialAdapter:
    """The LoRA configuration and weights a run with --adapter starts from (see the module
    docstring). resume_iteration: the iteration of --save's checkpoint (None: a fresh run).
    Raises AdapterSourceError / ConversionError (the CLI exits 2)."""
    from megatron_lora.export.adapter_ckpt import lora_config_from_dict
    from megatron_lora.training.checkpoint import read_run_metadata

    source = args.adapter
    given = getattr(args, "given_flags", None)
    allow = bool(getattr(args, "allow_other_base", False))  # lora/adapter_base.py
    if resume_iteration is not None:
        meta = (read_run_metadata(args.save).get("run_metadata") or {}).get("lora")
        lora = lora_config_from_dict(meta, source=f"--save {args.save}")
        result = InitialAdapter(source, None, lora, notes=[
            f"--save {args.save} has a checkpoint (iteration {resume_iteration}): resuming it; "
            f"--adapter {source} is not loaded (it applies only when a run starts, like "
            f"Megatron-LM's --finetune)"])
        whose, owner = f"--save {args.save}'s checkpoint", "the checkpoint's"
    elif os.path.isfile(os.path.join(source, PEFT_CONFIG)):
        from megatron_lora.export.from_peft import import_peft

        temp = tempfile.mkdtemp(prefix="megatron-lora-adapter-")
        try:
            out = os.path.join(temp, "imported")
            report = import_peft(source, out, hf_config=_base_config_path(args))
            lora, directory = _checkpoint_config(out, info, allow)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        result = InitialAdapter(source, directory, lora, imported=report, temp=temp, notes=[
            f"--adapter {source}: PEFT adapter imported (ranks {report['ranks']})"])
        whose, owner = f"--adapter {source}", "the adapter's"
    elif os.path.isdir(source):
        lora, directory = _checkpoint_config(source, info, allow)
        result = InitialAdapter(source, directory, lora)
        whose, owner = f"--adapter {source}", "the adapter's"
    else:
        raise AdapterSourceError(
            f"--adapter {source}: " + ("no such folder" if not os.path.exists(source) else
                                       "not a folder") +
            f"; expected an adapter checkpoint (a run folder with "
            f"latest_checkpointed_iteration.txt or an iter_* folder) or a PEFT adapter folder "
            f"({PEFT_CONFIG})")
    conflicts = flag_conflicts(args, result.lora, given, owner)
    if conflicts:
        result.cleanup()
        raise AdapterSourceError(
            f"{whose} has its own LoRA configuration, and these flags differ from it: "
            f"{'; '.join(conflicts)}. Its rank, alpha, targets, rsLoRA and patterns are used: "
            f"drop these flags (or give its values)")
    # Training-time settings with no parameter behind them are this run's.
    result.lora = dataclasses.replace(result.lora, lora_dropout=args.lora_dropout, seed=args.seed)
    if result.lora.dtype is None and resume_iteration is None:
        # An adapter that does not record its dtype (a PEFT import, older checkpoints): loaded
        # into this run's --lora-dtype. A resume keeps the checkpoint's setting as it was saved.
        from megatron_lora.lora.model import lora_dtype

        result.lora = dataclasses.replace(
            result.lora, dtype=lora_dtype(getattr(args, "lora_dtype", None) or "fp32"))
    return result
