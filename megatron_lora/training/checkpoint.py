"""Trainable-only (adapter) checkpoints through megatron dist_checkpointing, resumable at any layout.

Layout on disk:
    SAVE/latest_checkpointed_iteration.txt     the tracker: the newest complete iteration
    SAVE/iter_0000020/                         a megatron torch_dist checkpoint:
        model.*      trainable parameters only (the frozen base is never saved again)
        optimizer.*  megatron optimizer state for those parameters
        common       scheduler, iteration, consumed samples, run config (plain data); with
                     fp16 adapters also the dynamic loss scale (`loss_scale`)
    SAVE/iter_0000020/run_config.yaml           the flags of the run that wrote it (when its
                                                run metadata has a "run_config"; `train --config`)

No RNG state is saved: every random draw of a training step is keyed by (run seed, iteration,
micro-batch, adapter) or (seed, epoch) for the data order, so a resume is exact without one. The
per-rank `rng/` folder that older versions wrote is never opened.

A checkpoint is written into `iter_XXXXXXX.tmp`, renamed into place when every rank has finished,
and only then is the tracker replaced (write to a temporary file + os.replace). A crash at any
point leaves the previous checkpoint and the tracker pointing at it; `.tmp` folders are never
loaded. Every file is read as plain data through `runtime.safe_load` (the `.metadata` pickle with
an allow-list of exact classes, `common.pt` and tensor files with weights_only=True), only if it
resolves inside its folder (no symlink out: runtime/folder_files.py), and checked on every rank
before the first collective of a load.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_lora.lora.run_files import (  # noqa: F401 (the run folder's format, re-exported)
    RUN_CONFIG,
    TRACKER,
    CheckpointError,
    complete_iterations,
    iteration_dir,
    read_run_metadata,
    read_scheduler_state,
    read_tracker,
    resolve,
)
from megatron_lora.runtime.safe_load import CheckpointFileError, check_checkpoint, dist_load
from megatron_lora.training.optimizer import (
    LOSS_SCALE_KEYS,
    adam_step_tensor,
    loss_scale_state,
    set_loss_scale_state,
)

_ADAM_STATES = ("exp_avg", "exp_avg_sq")


def _write_tracker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, f".{TRACKER}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))


def trainable_sharded_state_dict(model_chunks: List[torch.nn.Module]) -> Dict:
    """Sharded state dict entries of trainable parameters only, per model chunk."""
    if len(model_chunks) != 1:
        raise NotImplementedError("virtual pipeline stages (several model chunks) are not supported")
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    out = {}
    for i, chunk in enumerate(model_chunks):
        module = getattr(chunk, "module", chunk)
        trainable = {name for name, p in module.named_parameters() if p.requires_grad}
        full = module.sharded_state_dict(metadata=metadata)
        out[f"model{i}"] = {k: v for k, v in full.items() if k in trainable}
        missing = trainable - set(out[f"model{i}"])
        if missing:
            raise RuntimeError(f"trainable parameters without a sharded state dict entry: "
                               f"{sorted(missing)[:5]}")
    return out


def _param_pairs(optimizer):
    """(torch optimizer, model param, main param) for every parameter of a megatron optimizer.

    The main param is the fp32 master copy for bf16 training, the model param itself in fp32.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = sub.optimizer
        if inner is None:  # a sub-optimizer with nothing to train here (e.g. only expert targets)
            continue
        if hasattr(sub, "float16_groups"):
            for model_group, main_group in zip(sub.float16_groups, sub.fp32_from_float16_groups):
                for model_p, main_p in zip(model_group, main_group):
                    yield inner, model_p, main_p
            for group in sub.fp32_from_fp32_groups:
                for p in group:
                    yield inner, p, p
        else:
            for group in inner.param_groups:
                for p in group["params"]:
                    yield inner, p, p


def optimizer_sharded_state(model_sd: Dict, optimizer, for_loading: bool = False) -> Dict:
    """Adam moments (and bf16 master weights) as ShardedTensors laid out like their parameters.

    Each state tensor is keyed by its parameter's global checkpoint key, so it reshards to any
    TP/PP/EP/DP layout exactly as the parameter does. (megatron's own optimizer checkpoint keys
    depend on how many sub-optimizers a layout has, e.g. a separate expert optimizer under EP, and
    so do not move between layouts.) The Adam step is the iteration number.
    """
    # ShardedTensor keys name a parameter across layers (the layer is an extra sharded axis), so
    # entries are indexed by the model's local state-dict name instead.
    by_ptr = {t.data.data_ptr(): (name, t) for name, t in model_sd.items()}
    out = {}
    for inner, model_p, main_p in _param_pairs(optimizer):
        if model_p.data_ptr() not in by_ptr:
            raise RuntimeError("an optimized parameter has no checkpoint entry")
        local, sharded = by_ptr[model_p.data_ptr()]
        state = inner.state[main_p]
        if for_loading and not state:
            state.update({name: torch.zeros_like(main_p) for name in _ADAM_STATES})
        names = list(_ADAM_STATES) + (["main_param"] if main_p is not model_p else [])
        for name in names:
            data = main_p.data if name == "main_param" else state[name]
            changes = dict(key=f"optimizer.{name}.{sharded.key}", data=data)
            if isinstance(sharded, ShardedTensor):
                changes["dtype"] = data.dtype
            # A ShardedTensorFactory (e.g. a gated fc1's [gate; up] split) keeps its build and
            # merge functions, so the state is split and merged exactly like the parameter.
            out[f"{name}/{local}"] = dataclasses.replace(sharded, **changes)
    return out


def _set_optimizer_state(model_sd: Dict, optimizer, loaded: Dict, iteration: int) -> None:
    by_ptr = {t.data.data_ptr(): name for name, t in model_sd.items()}
    for inner, model_p, main_p in _param_pairs(optimizer):
        key = by_ptr[model_p.data_ptr()]
        state = inner.state[main_p]
        for name in _ADAM_STATES:
            state[name] = loaded[f"{name}/{key}"].to(main_p.dtype)
        state["step"] = adam_step_tensor(inner, main_p, iteration)
        if main_p is not model_p:
            main_p.data.copy_(loaded[f"main_param/{key}"])


# Test seam: when set, called on every rank with the name of each step of a save as soon as that
# step is done ("shards_written": every rank's files are in iter_XXXXXXX.tmp; "renamed": the
# folder is in place, the tracker not yet replaced; "tracker_replaced"). A test makes it raise (or
# exit the process) to crash a save exactly between two steps. Never set in normal use.
_after_save_step: Optional[Callable[[str], None]] = None


def _save_step_done(step: str) -> None:
    if _after_save_step is not None:
        _after_save_step(step)


def _remove_abandoned(root: str) -> None:
    """Remove `iter_*.tmp` folders left by crashed saves (rank 0, before a save starts: only one
    save of a run is ever in flight, so any such folder is abandoned)."""
    for name in os.listdir(root):
        if name.startswith("iter_") and name.endswith(".tmp"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _write_run_config(directory: str, common: Dict) -> None:
    """run_config.yaml from common["run_metadata"]["run_config"] (rank 0, into the .tmp folder:
    it appears with the checkpoint, atomically)."""
    config = (common.get("run_metadata") or {}).get("run_config")
    if config is None:
        return
    from megatron_lora.training.run_folder import run_config_yaml

    with open(os.path.join(directory, RUN_CONFIG), "w") as f:
        f.write(run_config_yaml(config))


def save_checkpoint(root: str, iteration: int, model_chunks, optimizer, scheduler,
                    common: Dict) -> str:
    """Save trainable params, optimizer, scheduler and `common` (plain data) atomically.

    Steps, each complete before the next starts: (1) every rank writes into iter_XXXXXXX.tmp
    (rank 0 also run_config.yaml); (2) rank 0 renames it to iter_XXXXXXX; (3) rank 0 replaces
    the tracker and prints one line. A crash anywhere leaves the tracker naming a complete
    checkpoint (the previous one before step 3).
    """
    import time

    started = time.monotonic()
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    problem = None
    if dist.get_rank() == 0:
        try:
            os.makedirs(root, exist_ok=True)
            _remove_abandoned(root)
            if read_tracker(root) == iteration:
                # Rewriting the folder the tracker names would leave, for a moment, a tracker
                # that names nothing: a crash then would lose the run's only checkpoint.
                raise CheckpointError(
                    f"{final} is the checkpoint {os.path.join(root, TRACKER)} names; it is not "
                    f"overwritten in place: save to another folder")
            os.makedirs(tmp)
        except (OSError, CheckpointError) as exc:
            problem = str(exc)
    # Rank 0's verdict on every rank, so that all raise together instead of some waiting.
    verdict = [problem]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointError(verdict[0])
    model_sd = trainable_sharded_state_dict(model_chunks)
    state = dict(model_sd)
    state["optimizer"] = optimizer_sharded_state(model_sd["model0"], optimizer)
    state["scheduler"] = scheduler.state_dict()
    scale = loss_scale_state(optimizer)
    if scale is not None:  # fp16: a resume continues from the scale reached, not from 2**16
        state["loss_scale"] = scale
    state["common"] = dict(common, iteration=iteration)
    dist_checkpointing.save(state, tmp)
    if dist.get_rank() == 0:
        _write_run_config(tmp, common)
    dist.barrier()
    _save_step_done("shards_written")
    if dist.get_rank() == 0:
        # A folder of this iteration that the tracker does not name is a stale one (a crash
        # after its rename and before its tracker): replaced, never loaded.
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _save_step_done("renamed")
        _write_tracker(root, iteration)
        _save_step_done("tracker_replaced")
        print(f"saved checkpoint of iteration {iteration} to {final} "
              f"({time.monotonic() - started:.1f} s)", flush=True)
    dist.barrier()
    return final


def load_checkpoint(root: str, model_chunks, optimizer, scheduler, layout_name: str,
                    iteration: Optional[int] = None) -> Dict:
    """Load the tracker's (or the given) iteration into model/optimizer/scheduler; returns common.

    No RNG state is restored (none is needed, see the module docstring); an older checkpoint's
    `rng/` folder is ignored, never read. layout_name: this run's layout (a checkpoint loads at
    any layout: it reshards).
    """
    iteration = read_tracker(root) if iteration is None else iteration
    if iteration is None:
        raise FileNotFoundError(f"no checkpoint in {root} (no {TRACKER})")
    directory = iteration_dir(root, iteration)
    problem = None
    try:  # every file this rank reads, read and checked before the first collective
        saved = _common_state(directory, check_checkpoint(directory)[1])
        common = saved["common"]
    except CheckpointFileError as exc:
        problem = exc
    _agree(problem, directory)
    model_sd = trainable_sharded_state_dict(model_chunks)
    request = dict(model_sd)
    request["optimizer"] = optimizer_sharded_state(model_sd["model0"], optimizer, for_loading=True)
    loaded = dist_load(request, directory)
    for i, chunk in enumerate(model_chunks):
        module = getattr(chunk, "module", chunk)
        missing, unexpected = module.load_state_dict(loaded[f"model{i}"], strict=False)
        if unexpected:
            raise RuntimeError(f"{directory}: unexpected keys {unexpected[:5]}")
    _set_optimizer_state(model_sd["model0"], optimizer, loaded["optimizer"], iteration)
    scheduler.load_state_dict(saved["scheduler"])
    set_loss_scale_state(optimizer, saved.get("loss_scale"))
    return common


def _common_state(directory: str, saved: Optional[Dict]) -> Dict:
    """common.pt of a training checkpoint, checked: {"common": dict, "scheduler": dict, ...}."""
    path = os.path.join(directory, "common.pt")
    if saved is None:
        raise CheckpointFileError(path, "missing: not a complete training checkpoint")
    for key in ("common", "scheduler"):
        if not isinstance(saved.get(key), dict):
            raise CheckpointFileError(path, f"has no {key!r} dict: not a training checkpoint")
    scale = saved.get("loss_scale")
    if scale is not None and not (
            isinstance(scale, dict) and set(scale) == set(LOSS_SCALE_KEYS)
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in scale.values())):
        raise CheckpointFileError(path, f"'loss_scale' must map {', '.join(LOSS_SCALE_KEYS)} to "
                                  f"numbers, got {scale!r}")
    return saved


def _agree(problem: Optional[CheckpointFileError], directory: str) -> None:
    """Raise on every rank when any rank found a bad file (a rank whose view of the folder
    differs can fail alone): one all-reduce that every rank reaches, so no rank is left
    waiting."""
    from megatron_lora.runtime import device

    flag = torch.tensor([0 if problem is None else 1], dtype=torch.int32, device=device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if problem is not None:
        raise problem
    if int(flag.item()):
        raise OtherRankFileError(directory, "another rank could not read its checkpoint files "
                                            "(its error names the file)")


class OtherRankFileError(CheckpointFileError):
    """Raised on the ranks whose own files were fine when another rank's were not."""


def load_adapter_weights(model_chunks, path: str) -> Dict:
    """Load only the trainable (adapter) tensors of a checkpoint into a model that already has
    its adapters (apply_lora with the checkpoint's config); any layout. Collective."""
    directory = resolve(path)
    model_sd = trainable_sharded_state_dict(model_chunks)
    loaded = dist_load(dict(model_sd), directory)
    for i, chunk in enumerate(model_chunks):
        module = getattr(chunk, "module", chunk)
        _, unexpected = module.load_state_dict(loaded[f"model{i}"], strict=False)
        if unexpected:
            raise RuntimeError(f"{directory}: unexpected keys {unexpected[:5]}")
    return read_run_metadata(directory)
