"""train's output folders: is a `train --save` folder ours to write? Empty, missing, or a run.

A run writes its checkpoints (`iter_XXXXXXX/`, the tracker `latest_checkpointed_iteration.txt`),
its history (`metrics.jsonl`, `loss_curve.png`) and, with some flags, `tokenizer/` and `wandb/`
into --save, and resumes from what it finds there. Pointed at a folder that holds something
else (an HF model folder, a data folder), it would mix its files among those. So a --save folder
that exists must be empty, or a run folder: one holding the tracker, an iteration folder or
metrics.jsonl (what training/checkpoint.py and training/logging.py write first), or holding
only names a run writes (a run stopped before its first log line). Read from the file system
only, so every rank reaches the same verdict before any collective.
"""

from __future__ import annotations

import os
import re
from typing import Dict, Iterable, List

from megatron_lora.lora.run_files import TRACKER
from megatron_lora.training.logging import METRICS_FILE, PLOT_FILE

_ITERATION = re.compile(r"^iter_\d{7}(\.tmp)?$")
_RUN_NAMES = {TRACKER, METRICS_FILE, PLOT_FILE, "tokenizer", "wandb"}


def _written_by_a_run(name: str) -> bool:
    return (name in _RUN_NAMES or bool(_ITERATION.match(name))
            or (name.startswith(f".{TRACKER}.") and name.endswith(".tmp")))


def foreign_entries(folder: str, also: Iterable[str] = ()) -> List[str]:
    """[] when `folder` may take a run (missing, empty, or a run folder: module docstring);
    otherwise the entries (sorted) that are not a run's. `also`: more names the run writes
    there (a --tensorboard-dir inside --save)."""
    if not os.path.isdir(folder):
        return []
    names = sorted(os.listdir(folder))
    marks = (TRACKER, METRICS_FILE)
    if any(n in marks or (_ITERATION.match(n) and not n.endswith(".tmp")) for n in names):
        return []
    return [n for n in names if not _written_by_a_run(n) and n not in set(also)]


def save_problem(folder: str, also: Iterable[str] = (), flag: str = "--save") -> str:
    """'' when `folder` may take a run; else one line naming up to 4 entries found and what to
    do."""
    foreign = foreign_entries(folder, also)
    if not foreign:
        return ""
    shown = ", ".join(foreign[:4]) + (f" and {len(foreign) - 4} more" if len(foreign) > 4 else "")
    return (f"{flag} {folder} already holds files that are not a training run ({shown}); a "
            f"run writes its checkpoints and logs into {flag}: give a new or empty folder, or "
            f"the folder of an earlier run to resume it")


def check_outputs(args) -> None:
    """train's --save and --tensorboard-dir: existing folders are fine (a run resumes / adds to
    them), but not a file in the way, an unwritable location or an overlap with an input, nor a
    --save folder holding something other than a run (OutputError naming the flag)."""
    from megatron_lora.convert.outputs import OutputError, check_output

    inputs = {"--load": args.load, "--load-hf": args.load_hf, "--hf-config": args.hf_config,
              **_data_inputs(args.data_path), "--tokenizer": args.tokenizer,
              "--valid-data-path": getattr(args, "valid_data_path", None),
              "--adapter": getattr(args, "adapter", None)}
    inputs = {k: v for k, v in inputs.items() if v}
    for flag, path in (("--save", args.save), ("--tensorboard-dir", args.tensorboard_dir)):
        if path:
            check_output(path, kind="dir", exists_ok=True, inputs=inputs, flag=flag)
    if args.save:
        save = os.path.realpath(args.save)
        inside = [os.path.basename(os.path.realpath(p)) for p in (
            args.tensorboard_dir, getattr(args, "wandb_save_dir", None))
            if p and os.path.dirname(os.path.realpath(p)) == save]
        problem = save_problem(args.save, inside)
        if problem:
            raise OutputError(problem)


def _data_inputs(values) -> dict:
    """{flag: path} of the --data-path files (a prefix's .bin and .idx; a blend's every path)."""
    from megatron_lora.data.indexed import is_prefix

    values = [values] if isinstance(values, str) else list(values)
    paths = values[1::2] if len(values) > 1 else values  # a blend: W1 PATH1 W2 PATH2 ...
    out = {}
    for i, path in enumerate(paths):
        name = "--data-path" if i == 0 else f"--data-path ({i + 1})"
        out.update({name + " .bin": path + ".bin", name + " .idx": path + ".idx"}
                   if is_prefix(path) else {name: path})
    return out


def run_config_yaml(config: Dict[str, object], command: str = "megatron-lora train") -> str:
    """YAML text of a resolved configuration (yaml.safe_dump, keys in the given order): the
    run_config.yaml each checkpoint holds, usable as `train --config`."""
    import yaml

    head = (f"# {command}: every flag's final value for this run. Rerun it with\n"
            f"#   {command} --config THIS_FILE [--save ANOTHER_FOLDER]\n")
    return head + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)
