"""What `megatron-lora train` does on each rank: check inputs, build the model, apply LoRA, train."""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

import torch

from megatron_lora.cli import quantization
from megatron_lora.cli.train_flags import (  # noqa: F401  (TrainSetupError: cli/train.py's)
    TrainSetupError, as_flags, refuse_prefix_flags, prefix_config)


def _per_rank(exc: BaseException) -> bool:
    """Whether a failure of a checkpoint load may differ between ranks: a per-rank file this
    rank could not read (the other ranks raise OtherRankFileError, the same on each)."""
    from megatron_lora.runtime.safe_load import CheckpointFileError
    from megatron_lora.training.checkpoint import OtherRankFileError

    return isinstance(exc, CheckpointFileError) and not isinstance(exc, OtherRankFileError)


def _setup_checks(args, layout, world_size):
    """Everything that can be checked without communication; raises TrainSetupError.

    With --adapter, the LoRA settings of args are replaced by the adapter's (or, on a resume,
    the --save checkpoint's; training/initial_adapter.py), so that the run's resolved
    configuration records what is used; the returned InitialAdapter says what to load (its
    temporary folder, if any, is removed here when a later check fails)."""
    from megatron_lora.convert.errors import ConversionError
    from megatron_lora.families import ModelConfigError
    from megatron_lora.lora.model import LoraConfig
    from megatron_lora.lora.sizes import model_problems
    from megatron_lora.runtime import LayoutError
    from megatron_lora.training.loop import RunConfig
    from megatron_lora.training.optimizer import OptimConfig
    from megatron_lora.training.run_folder import check_outputs

    initial = None
    try:
        prefix = None  # the flags alone decide a prefix run's config: checked before any file
        if getattr(args, "peft_type", "lora") == "prefix" and not getattr(args, "adapter", None):
            prefix = prefix_config(args)
        elif not getattr(args, "adapter", None):
            refuse_prefix_flags(args)
        if args.load_hf:
            from megatron_lora.convert.hf_to_mcore import open_hf

            info, hf, _ = open_hf(args.load_hf)
        else:
            from megatron_lora.convert.hf_to_mcore import read_mcore_info

            info, hf = read_mcore_info(args.load, args.hf_config), None
        info.validate_layout(layout, world_size, flags=True)
        from megatron_lora.convert.checks import check_before_build  # config vs checkpoint, memory

        check_before_build(info, layout, torch.bfloat16 if args.bf16 else torch.float32,
                           load=args.load, hf_config=args.hf_config)
        check_outputs(args)  # training/run_folder.py
        resume_at = None
        if args.save:  # a tracker naming a missing iteration: refused before any model exists
            from megatron_lora.training.checkpoint import read_tracker

            resume_at = read_tracker(args.save)
        token_ids = tuple(_tokenizer(args, info, grow=True)[1])  # --add-special-tokens
        if token_ids:  # past the padded rows: a grown vocabulary (--load-hf only)
            from megatron_lora.lora.trainable_tokens import info_for_tokens

            info = info_for_tokens(info, token_ids, load=args.load)
            info.validate_layout(layout, world_size, flags=True)
        if getattr(args, "adapter", None):
            from megatron_lora.training.initial_adapter import (open_initial_adapter,
                                                                set_lora_flags)

            initial = open_initial_adapter(args, info, resume_at)
            lora = initial.lora
            set_lora_flags(args, lora)
            if tuple(lora.trainable_token_indices) != token_ids:
                raise TrainSetupError(
                    f"--adapter {args.adapter} trains the token ids "
                    f"{list(lora.trainable_token_indices)}, but --add-special-tokens with "
                    f"--tokenizer gives {list(token_ids)}; pass the base --tokenizer the adapter "
                    f"was trained from and the same --add-special-tokens, in the same order")
        elif prefix is not None:
            lora = prefix
        else:
            try:
                lora = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha,
                                  lora_dropout=args.lora_dropout,
                                  target_modules=args.lora_target_modules,
                                  use_rslora=args.lora_use_rslora, seed=args.seed,
                                  use_dora=bool(getattr(args, "lora_use_dora", False)),
                                  dtype=getattr(args, "lora_dtype", None) or "fp32",
                                  rank_pattern=dict(getattr(args, "lora_rank_pattern", None) or []),
                                  alpha_pattern=dict(getattr(args, "lora_alpha_pattern", None)
                                                     or []),
                                  trainable_token_indices=token_ids)
            except ValueError as exc:  # the config names its fields; the user typed flags
                raise TrainSetupError(as_flags(str(exc))) from None
        run = RunConfig(micro_batch_size=args.micro_batch_size,
                        global_batch_size=args.global_batch_size, seq_length=args.seq_length,
                        train_iters=args.train_iters, log_interval=args.log_interval,
                        save=args.save, save_interval=args.save_interval,
                        eval_interval=args.eval_interval, eval_iters=args.eval_iters,
                        tensorboard_dir=args.tensorboard_dir, seed=args.seed,
                        wandb_project=getattr(args, "wandb_project", None),
                        wandb_exp_name=getattr(args, "wandb_exp_name", None),
                        wandb_save_dir=getattr(args, "wandb_save_dir", None))
        problems = run.batch_problems(layout.data_parallel_size(world_size))
        problems += model_problems(lora, info, rank_name="--lora-rank", pattern_name=
                                   "--lora-rank-pattern", targets_name="--lora-target-modules",
                                   alpha_pattern_name="--lora-alpha-pattern")
        if layout.sp and args.seq_length % layout.tp:
            problems.append(f"--seq-length {args.seq_length} is not divisible by "
                            f"--tensor-model-parallel-size {layout.tp} (sequence parallelism)")
        if args.seq_length > info.shape.max_position_embeddings:
            problems.append(f"--seq-length {args.seq_length} exceeds the model's "
                            f"max_position_embeddings {info.shape.max_position_embeddings}")
        problems += _attention_backend_problems(args)
        problems += _recompute_problems(args, info.shape.num_layers // layout.pp)
        problems += quantization.quantization_problems(args, info, layout)  # nf4: widths
        problems += quantization.saved_quantization_problems(args, resume_at, initial)
        if info.shape.mla is not None and args.transformer_impl != "local":
            problems.append(f"--transformer-impl {args.transformer_impl}: multi-latent attention "
                            f"(DeepSeek) is built from the local layers; use --transformer-impl "
                            f"local")
        if getattr(args, "moe_grouped_gemm", None) and args.transformer_impl != "local":
            problems.append("--moe-grouped-gemm builds grouped experts from the local layers; use "
                            "it with --transformer-impl local (or pass --no-moe-grouped-gemm)")
        if not 0.0 <= args.eval_fraction < 1.0:
            problems.append(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
        if getattr(args, "valid_data_path", None) and args.eval_fraction:
            problems.append(f"--valid-data-path and --eval-fraction both give validation data "
                            f"(--valid-data-path {args.valid_data_path}, --eval-fraction "
                            f"{args.eval_fraction}); give one of them")
        if problems:
            raise TrainSetupError("; ".join(problems))
        optim = OptimConfig(lr=args.lr, min_lr=args.min_lr, lr_warmup_iters=args.lr_warmup_iters,
                            lr_decay_style=args.lr_decay_style, train_iters=args.train_iters,
                            weight_decay=args.weight_decay, clip_grad=args.clip_grad,
                            **{k: getattr(args, k, False) for k in (
                                "override_opt_param_scheduler",
                                "use_checkpoint_opt_param_scheduler")})
        datasets = _datasets(args, info, run)
    except BaseException as exc:
        if initial is not None:
            initial.cleanup()
        if isinstance(exc, TrainSetupError) or not isinstance(
                exc, (ConversionError, ModelConfigError, LayoutError, ValueError, OSError)):
            raise
        raise TrainSetupError(str(exc)) from None
    return info, hf, lora, run, optim, datasets, initial


def _attention_backend_problems(args) -> list:
    from megatron_lora.models.specs import core_attention_class

    backend = getattr(args, "attention_backend", None)
    try:
        core_attention_class(backend)
    except ValueError as exc:
        return [f"--attention-backend: {exc}"]
    if args.transformer_impl == "transformer_engine" and backend not in (None, "auto"):
        return [f"--attention-backend {backend} selects the local layers' core attention; use it "
                "with --transformer-impl local (Transformer Engine layers use their own)"]
    return []


def _recompute_settings(args) -> tuple:
    return tuple(getattr(args, name, None) for name in (
        "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules"))


def _recompute_problems(args, layers_per_stage: int) -> list:
    """--recompute-* flags against the model's layers per pipeline stage (models/recompute.py)."""
    from megatron_lora.models.recompute import recompute_problems

    return recompute_problems(*_recompute_settings(args), layers_per_stage)


def _datasets(args, info, run):
    """(train, evaluation or None, stats) from --data-path (JSONL, an indexed prefix or a
    weighted blend of them: data/sources.py), --eval-fraction and --valid-data-path."""
    from megatron_lora.data import DataError, load_tokenizer
    from megatron_lora.data.sources import open_data

    tokenizer = _tokenizer(args, info)[0]
    split = None
    if getattr(args, "split", None):
        from megatron_lora.data.sources import parse_split

        split = parse_split(args.split)
        given = [f for f, v in (("--eval-fraction", args.eval_fraction),
                                ("--valid-data-path", getattr(args, "valid_data_path", None)))
                 if v]
        if given:
            raise TrainSetupError(f"--split {args.split} and {' and '.join(given)} all give "
                                  f"validation data; give one of them")
    data = open_data(args.data_path, tokenizer, run.seq_length, run.seed,
                     eval_fraction=args.eval_fraction, split=split)
    train, evaluation = data.train, data.held_out
    n_eval = len(evaluation) if evaluation is not None else 0
    n = len(train) + n_eval
    valid_path = getattr(args, "valid_data_path", None)
    if args.eval_interval and not valid_path and n_eval == 0:
        raise TrainSetupError(
            "--eval-interval needs validation data: give --valid-data-path FILE, or hold out "
            "part of --data-path with --eval-fraction F" + (
                f" (--eval-fraction {args.eval_fraction} of {n} sequences rounds to none)"
                if args.eval_fraction else "") + (
                f" (--split {args.split} of {n} sequences gives none)" if split else ""))
    stats = dict(samples=data.samples, truncated=data.truncated, sequences=n - n_eval,
                 held_out=n_eval)
    if valid_path:
        # Packed like --data-path; evaluate() reads its batches from the start of the order
        # PackedDataset derives from --seed, as for the --eval-fraction held-out part.
        try:
            valid = open_data(valid_path, tokenizer, run.seq_length, run.seed,
                              flag="--valid-data-path")
        except DataError as exc:  # names file:line; the flag tells which input it is
            message = str(exc)
            raise TrainSetupError(message if message.startswith("--valid-data-path") else
                                  f"--valid-data-path: {message}") from None
        evaluation = valid.train
        stats.update(valid_samples=valid.samples, valid_truncated=valid.truncated,
                     held_out=len(evaluation))
    return train, evaluation, stats


def _tokenizer(args, info, grow: bool = False):
    """(--tokenizer with --add-special-tokens added, the new tokens' ids); TrainSetupError.
    grow: the ids may lie past info's padded vocabulary (see trainable_tokens.info_for_tokens)."""
    from megatron_lora.data.tokenizers import TokenizerError, load_training_tokenizer

    try:
        return load_training_tokenizer(args.tokenizer, getattr(args, "add_special_tokens", None)
                                       or [], info.vocab_size,
                                       None if grow else info.shape.vocab_size)
    except TokenizerError as exc:
        raise TrainSetupError(str(exc)) from None


def _say(rank0: bool, text: str) -> None:
    if rank0:
        print(text, flush=True)


def run_training(args, run_config: Callable[[], dict]) -> int:
    """`megatron-lora train` on this rank: checks (no collective), then _train.

    run_config: gives every train flag's final value (plain data, cli/run_config.py `resolved`)
    once the setup checks have settled them (--adapter replaces the LoRA flags), saved as
    run_config.yaml next to each checkpoint, usable as --config."""
    from megatron_lora.cli.common import layout_from_args, torchrun_env_defaults
    from megatron_lora.training import interrupt

    torchrun_env_defaults(29519)
    world_size = int(os.environ["WORLD_SIZE"])
    try:
        layout = layout_from_args(args)
    except ValueError as exc:
        raise TrainSetupError(str(exc)) from None
    progress = interrupt.Progress()
    previous = interrupt.watch()
    try:  # Ctrl-C anywhere: one line on rank 0, exit 130 (training/interrupt.py)
        info, hf, lora, run, optim, (train_set, eval_set, stats), initial = _setup_checks(
            args, layout, world_size)
        if args.save:
            from megatron_lora.training.checkpoint import read_tracker

            progress.iteration = read_tracker(args.save) or 0  # a resume starts there
        try:
            return _train(args, layout, info, hf, lora, run, optim, train_set, eval_set, stats,
                          initial, progress, run_config)
        finally:
            if initial is not None:
                initial.cleanup()
    except BaseException as exc:  # also a peer's error seen by a rank interrupted in a collective
        if isinstance(exc, KeyboardInterrupt) or interrupt.received():
            raise interrupt.interrupted(progress, args.save) from None
        raise
    finally:
        interrupt.unwatch(previous)


def _train(args, layout, info, hf, lora, run, optim, train_set, eval_set, stats, initial,
           progress, run_config: Callable[[], dict]) -> int:
    import torch.distributed as dist

    from megatron_lora import runtime
    from megatron_lora.cli.model_setup import build_base
    from megatron_lora.lora.model import apply_lora
    from megatron_lora.models.build import model_config
    from megatron_lora.models.recompute import recompute_overrides
    from megatron_lora.training.loop import ResumeMismatchError, train

    runtime.init_process_group()
    rank0 = dist.get_rank() == 0
    if not args.save and rank0:  # before the work, not after it
        print("megatron-lora train: warning: no --save: the trained adapter is not saved (it is "
              "discarded when the run ends); give --save DIR to keep it", file=sys.stderr,
              flush=True)
    runtime.initialize(layout, seed=args.seed, model_sizes=info.shape.layout_sizes())
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    base = f"--load-hf {args.load_hf}" if hf is not None else f"--load {args.load}"
    _say(rank0, f"loading the base model ({base}, {layout.describe()} on {dist.get_world_size()} "
                f"ranks, {str(dtype).replace('torch.', '')}) ...")
    loading = time.monotonic()
    model = build_base(info, model_config(info, layout, dtype=dtype,
                                          dispatcher=args.moe_token_dispatcher_type,
                                          **recompute_overrides(*_recompute_settings(args))),
                       hf=hf, load=args.load,
                       base_quantization=getattr(args, "base_quantization", "none"),
                       use_te=args.transformer_impl == "transformer_engine",
                       attention_backend=getattr(args, "attention_backend", None),
                       moe_grouped_gemm=getattr(args, "moe_grouped_gemm", None))
    _say(rank0, f"loaded the base model in {time.monotonic() - loading:.1f} s")
    held = (f"+{stats['held_out']} validation sequences from --valid-data-path "
            f"{args.valid_data_path}" if getattr(args, "valid_data_path", None) else
            f"+{stats['held_out']} held out")
    _say(rank0, f"data: {stats['samples']} samples ({stats['truncated']} truncated to "
                f"--seq-length+1 tokens) packed into {stats['sequences']} sequences of "
                f"{run.seq_length} ({held})")
    apply_lora(model, lora)
    if lora.trainable_token_indices and args.save and rank0:  # the tokenizer beside the adapter
        saved = _tokenizer(args, info)[0].save(os.path.join(args.save, "tokenizer"))
        _say(rank0, f"tokenizer with --add-special-tokens {' '.join(args.add_special_tokens)} "
                    f"(ids {list(lora.trainable_token_indices)}): {saved}")
    if initial is not None:
        for note in initial.notes:
            _say(rank0, f"notice: {note}")
        if initial.directory is not None:
            from megatron_lora.training.checkpoint import load_adapter_weights

            load_adapter_weights([model], initial.directory)  # collective
            initial.cleanup()
            _say(rank0, f"initial adapter weights from --adapter {initial.source} (a fresh "
                        f"optimizer and LR schedule, from iteration 0)")
    from megatron_lora.lora.adapter_base import base_record

    metadata = {"lora": lora.to_dict(), "base": base_record(info), "vocab_size": info.vocab_size,
                "hidden_size": info.shape.hidden_size, "num_layers": info.shape.num_layers,
                "num_experts": info.shape.num_experts,
                # Not compared on resume (training/resume.py): this run's flags, written as
                # run_config.yaml into each checkpoint (training/checkpoint.py).
                "run_config": run_config()}
    start = time.monotonic()
    try:
        result = train([model], train_set, run, optim, layout_name=layout.describe(),
                       run_metadata=metadata, eval_dataset=eval_set, on_iteration=progress,
                       model_shape=info.shape, lora_config=lora)
    except (ResumeMismatchError, ValueError) as exc:  # raised on every rank before any step
        runtime.shutdown()
        raise TrainSetupError(str(exc), every_rank=_per_rank(exc)) from None
    if rank0:
        print(f"{result.describe()} in {time.monotonic() - start:.1f} s; "
              f"final loss {result.losses.get(result.iteration, float('nan')):.4f}")
        if result.checkpoint:
            print(f"adapter checkpoint: {result.checkpoint}")
        if run.tensorboard_dir:
            print(f"tensorboard logs: {run.tensorboard_dir}")
        if result.plot:
            print(f"loss curve: {result.plot}")
        sys.stdout.flush()
    runtime.shutdown()
    return 0
