"""`megatron-lora train`: LoRA fine-tuning of an MoE checkpoint of a supported family (under torchrun).

    torchrun --nproc-per-node 8 -m megatron_lora train --load-hf Mixtral-8x7B-v0.1 \\
        --tensor-model-parallel-size 2 --expert-model-parallel-size 4 --sequence-parallel \\
        --data-path train.jsonl --tokenizer Mixtral-8x7B-v0.1 --seq-length 4096 \\
        --micro-batch-size 1 --global-batch-size 64 --train-iters 1000 --lr 2e-4 \\
        --lora-rank 16 --lora-alpha 32 --lora-target-modules linear_qkv linear_proj linear_fc1 linear_fc2 \\
        --save ckpt/run1 --save-interval 100 --bf16

Flag names follow Megatron-LM. Every input (layout, batch sizes, data, LoRA settings, a resume's
compatibility) is checked on every rank before training starts. `--config run.yaml` takes flags
from a YAML file (cli/run_config.py; the command line overrides it); like Megatron-LM's parser,
this one takes no abbreviated flag names. `--adapter DIR` starts from an adapter's weights
(training/initial_adapter.py).
"""

from __future__ import annotations

import argparse
import sys

from megatron_lora.cli.common import add_layout_args
from megatron_lora.cli.quantization import add_quantization_arg
from megatron_lora.cli.run_config import CONFIG_FLAG, ConfigArgumentParser


def register(sub) -> None:
    p = sub.add_parser("train", help="LoRA fine-tuning (torchrun)", allow_abbrev=False,
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="LoRA fine-tuning of an MoE checkpoint (docs/families.md); run it under "
                       "torchrun (or as one process for world size 1). Flag names follow "
                       "Megatron-LM.")
    p.__class__ = ConfigArgumentParser  # reads --config FILE before parsing (cli/run_config.py)
    add_arguments(p)
    p.set_defaults(func=_run)


def parser() -> argparse.ArgumentParser:
    """train's flags as a standalone parser (for the resolved run configuration and tests)."""
    p = ConfigArgumentParser(prog="megatron-lora train", allow_abbrev=False,
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    return p


def add_arguments(p) -> None:
    p.add_argument(CONFIG_FLAG, default=None, metavar="FILE",
                   help="YAML file of flags (keys: flag names without dashes, e.g. "
                   "'lora-rank: 8'; lists for several values, true for switches); flags on the "
                   "command line override it. Every checkpoint's run_config.yaml is such a file")
    add_layout_args(p)
    src = p.add_argument_group("model")
    which = src.add_mutually_exclusive_group(required=True)
    which.add_argument("--load-hf", help="HF model folder, read directly (each rank its slices)")
    which.add_argument("--load", help="megatron-core checkpoint from `convert hf-to-mcore`")
    src.add_argument("--adapter", default=None, metavar="DIR",
                     help="start from this adapter's weights (Megatron-LM's --finetune: weights "
                     "only, a fresh optimizer, iteration 0): an adapter checkpoint of ours (a run "
                     "folder or an iter_* folder) or a PEFT adapter folder (imported on the fly). "
                     "Its LoRA rank, alpha, targets, rsLoRA and patterns are used; --lora-* flags "
                     "that differ are an error. A --save folder that has a checkpoint is resumed "
                     "instead")
    src.add_argument("--allow-other-base", action="store_true", help="start from an --adapter "
                     "recorded as trained on another base model (another family or other sizes)")
    src.add_argument("--hf-config", default=None, help="config.json for --load if it has none")
    src.add_argument("--transformer-impl", choices=["local", "transformer_engine"],
                     default="local", help="layer implementation; LoRA on Transformer Engine's "
                     "LayerNorm-fused linears is not available yet, so 'local' is the default")
    src.add_argument("--attention-backend", choices=["flash", "fused", "unfused", "local", "auto"],
                     default=None, help="core attention of the local layers (Megatron-LM's "
                     "names): 'flash'/'auto' torch's fused scaled_dot_product_attention (memory "
                     "linear in --seq-length), 'unfused'/'local' megatron's DotProductAttention "
                     "(the default); 'fused' needs Transformer Engine and is refused")
    src.add_argument("--moe-grouped-gemm", action=argparse.BooleanOptionalAction, default=None,
                     help="all local experts in one grouped matmul per weight and LoRA factor "
                     "(GroupedExperts; the same checkpoints as megatron's per-expert "
                     "SequentialMLP, which --no-moe-grouped-gemm selects). Default: on with "
                     "--transformer-impl local on CUDA GPUs, off on CPU (slower there)")
    add_quantization_arg(src)
    d = p.add_argument_group("data")
    data_path = d.add_argument(
        "--data-path", required=True, nargs="+", metavar="PATH",
        help="JSONL ({text} or {prompt, response} or {messages} lines), an indexed dataset "
        "prefix from `megatron-lora preprocess` or Megatron-LM (PREFIX.bin/.idx, memory-mapped), "
        "or Megatron-LM's weighted blend of them: W1 PATH1 W2 PATH2 ...")
    data_path.scalar_is_one_value = True  # a --config file may give one path as a string
    d.add_argument("--tokenizer", required=True, help="tokenizer.json, an HF folder with one, "
                   "or 'byte'")
    d.add_argument("--seq-length", type=int, required=True,
                   help="tokens per packed sequence (longer samples are truncated)")
    d.add_argument("--eval-fraction", type=float, default=0.0,
                   help="fraction of the --data-path sequences held out for --eval-interval "
                   "(or give --valid-data-path)")
    d.add_argument("--split", default=None, metavar="A,B,C",
                   help="Megatron-LM's train,validation,test weights of each --data-path path's "
                   "packed sequences, e.g. 98,2,0: the first A/(A+B+C) train, the next "
                   "B/(A+B+C) are the validation data for --eval-interval, the test part is not "
                   "used (instead of --eval-fraction)")
    d.add_argument("--valid-data-path", default=None, metavar="FILE",
                   help="validation data for --eval-interval: a JSONL file or an indexed "
                   "prefix, as for --data-path (instead of --eval-fraction)")
    t = p.add_argument_group("training")
    t.add_argument("--micro-batch-size", type=int, default=1,
                   help="sequences per micro-batch on each data-parallel rank")
    t.add_argument("--global-batch-size", type=int, required=True,
                   help="sequences per iteration over all data-parallel ranks (gradient "
                   "accumulation makes up the rest)")
    t.add_argument("--train-iters", type=int, required=True,
                   help="iterations of the whole run (a resume continues up to it)")
    t.add_argument("--lr", type=float, default=1e-4, help="peak learning rate")
    t.add_argument("--min-lr", type=float, default=0.0, help="learning rate at the end of decay")
    t.add_argument("--lr-warmup-iters", type=int, default=0,
                   help="iterations of linear warmup from 0 to --lr")
    t.add_argument("--lr-decay-style", default="cosine",
                   choices=["constant", "linear", "cosine", "inverse-square-root"],
                   help="decay from --lr to --min-lr over --train-iters")
    t.add_argument("--clip-grad", type=float, default=1.0,
                   help="gradient clipping by global norm (0: none)")
    t.add_argument("--weight-decay", type=float, default=0.0,
                   help="Adam weight decay of the adapter parameters")
    t.add_argument("--bf16", action="store_true", help="bf16 model and activations (else fp32)")
    t.add_argument("--seed", type=int, default=1234,
                   help="seed of the adapters' initial factors, data order and dropout")
    sched = t.add_mutually_exclusive_group()
    sched.add_argument("--override-opt_param-scheduler", action="store_true",
                       help="on resume, take every LR scheduler setting (--lr, --min-lr, "
                       "--lr-warmup-iters, --lr-decay-style, --train-iters, --weight-decay) from "
                       "the command line, ignoring the checkpoint's")
    sched.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                       help="on resume, take every LR scheduler setting from the checkpoint "
                       "(default: they must match, except --train-iters, the decay horizon)")
    rc = p.add_argument_group("activation recomputation (Megatron-LM's flags)")
    rc.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                    help="full: keep only the input of checkpointed layers and run them again in "
                    "backward; selective: recompute only --recompute-modules")
    rc.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                    help="with full: uniform checkpoints every chunk of --recompute-num-layers "
                    "layers, block the first --recompute-num-layers layers of each pipeline stage")
    rc.add_argument("--recompute-num-layers", type=int, default=None, metavar="N",
                    help="with full: layers per chunk (uniform) or per stage (block)")
    rc.add_argument("--recompute-modules", nargs="+", default=None, metavar="MODULE",
                    help="with selective: core_attn (the default: attention scores and "
                    "probabilities) and/or moe (the whole MoE layer)")
    lo = p.add_argument_group("LoRA")
    lo.add_argument("--lora-rank", type=int, default=16, help="LoRA rank r")
    lo.add_argument("--lora-alpha", type=float, default=32.0,
                    help="LoRA alpha: the update is scaled by alpha/r (alpha/sqrt(r) with "
                    "--lora-use-rslora)")
    lo.add_argument("--lora-dropout", type=float, default=0.0,
                    help="dropout probability on the adapters' input")
    lo.add_argument("--lora-target-modules", nargs="+", metavar="MODULE",
                    default=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                    help="modules to adapt: megatron names (linear_qkv, linear_proj, linear_fc1, "
                    "linear_fc2, router, embedding, output_layer), their HF names (q_proj ... "
                    "w1, w2, w3, gate, embed_tokens, lm_head) or all-linear")
    lo.add_argument("--lora-use-rslora", action="store_true",
                    help="rank-stabilized LoRA: scale by alpha/sqrt(r)")
    lo.add_argument("--lora-use-dora", action="store_true",
                    help="DoRA (PEFT's use_dora): a trained magnitude per output row of each "
                    "adapted linear (linear_qkv, linear_proj, linear_fc1, linear_fc2 only)")
    lo.add_argument("--lora-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                    help="dtype of the adapter parameters, their gradients and checkpoints "
                    "(the base model keeps its own, see --bf16); bf16 / fp16 adapters train with "
                    "fp32 master weights in the optimizer (fp16 with a dynamic loss scale)")
    tokens = lo.add_argument(
        "--add-special-tokens", nargs="+", default=[], metavar="TOKEN",
        help="new special tokens (e.g. '<|im_start|>' '<|im_end|>') added to --tokenizer (the "
        "extended tokenizer is saved in --save/tokenizer); their embedding and output-layer rows "
        "(free rows of the padded vocabulary) are trained with the adapters and exported as "
        "PEFT's trainable_token_indices. Not with LoRA on embedding / output_layer")
    tokens.scalar_is_one_value = True  # a --config file may give one token as a string
    lo.add_argument("--lora-rank-pattern", nargs="+", default=[], type=_rank_pattern,
                    metavar="REGEX=R", help="rank R instead of --lora-rank for the adapters whose "
                    "global name REGEX matches (re.search), e.g. router=4 for a router with few "
                    "experts; one rank per target kind")
    lo.add_argument("--lora-alpha-pattern", nargs="+", default=[], type=_alpha_pattern,
                    metavar="REGEX=A", help="alpha A instead of --lora-alpha for the adapters "
                    "whose global name REGEX matches (re.search), e.g. router=8")
    pt = p.add_argument_group("prefix tuning")
    pt.add_argument("--peft-type", choices=("lora", "prefix"), default="lora",
                    help="lora: LoRA on --lora-target-modules; prefix: prefix tuning (PEFT's "
                    "PREFIX_TUNING): --num-virtual-tokens learned keys/values per layer that "
                    "every token attends to, exported as PEFT's prefix adapter; not combinable "
                    "with the --lora-* adapter flags or --add-special-tokens (PEFT loads one "
                    "adapter type per adapter)")
    pt.add_argument("--num-virtual-tokens", type=int, default=None, metavar="N",
                    help="with --peft-type prefix: the prefix length (PEFT's num_virtual_tokens)")
    pt.add_argument("--prefix-projection", action="store_true",
                    help="with --peft-type prefix: the prefix comes from a two-layer MLP shared "
                    "by all layers (PEFT's prefix_projection); exported as the projected table")
    pt.add_argument("--prefix-encoder-hidden-size", type=int, default=None, metavar="N",
                    help="with --prefix-projection: the MLP's hidden size (PEFT's "
                    "encoder_hidden_size; default: kv heads x head dim)")
    o = p.add_argument_group("output")
    o.add_argument("--save", default=None, help="adapter checkpoints; a run resumes from the "
                   "newest one found here")
    o.add_argument("--save-interval", type=int, default=None,
                   help="save a checkpoint every N iterations (and always at the end)")
    o.add_argument("--eval-interval", type=int, default=None,
                   help="validation loss every N iterations (needs --valid-data-path or "
                   "--eval-fraction)")
    o.add_argument("--eval-iters", type=int, default=1,
                   help="global batches per validation")
    o.add_argument("--log-interval", type=int, default=1, help="one log line every N iterations")
    o.add_argument("--tensorboard-dir", default=None, help="TensorBoard scalars folder")
    o.add_argument("--wandb-project", default=None, help="Weights & Biases project: log the "
                   "run there (needs the wandb package; WANDB_MODE=offline works without a "
                   "network)")
    o.add_argument("--wandb-exp-name", default=None, help="Weights & Biases run name")
    o.add_argument("--wandb-save-dir", default=None, help="folder for Weights & Biases files "
                   "(unset: a wandb folder in --save)")


def _pattern(text: str, value, what: str, example: str):
    """REGEX=V for the pattern flags: (regex, value(V)); value returns None for a bad V. Else
    exit 2 with usage (argparse names the flag)."""
    import re

    regex, sep, raw = text.rpartition("=")
    parsed = value(raw) if sep and regex else None
    if parsed is None:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {what}, e.g. {example}")
    try:
        re.compile(regex)
    except re.error as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {regex!r} is not a regular expression "
                                         f"({exc})") from None
    return regex, parsed


def _positive_int(raw: str):
    return int(raw) if raw.isdigit() and int(raw) >= 1 else None


def _positive_float(raw: str):
    import math

    try:
        value = float(raw)
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None


def _rank_pattern(text: str):
    """REGEX=R for --lora-rank-pattern: (regex, positive int R)."""
    return _pattern(text, _positive_int, "REGEX=R with R a positive integer", "router=4")


def _alpha_pattern(text: str):
    """REGEX=A for --lora-alpha-pattern: (regex, positive finite float A)."""
    return _pattern(text, _positive_float, "REGEX=A with A a positive number", "router=8")


def _rank0() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"


def _leave_it_to_rank0(message: str, wait_s: float = 30.0) -> None:
    """On a rank other than 0 with the error every rank found. Under torchrun (whose output is
    all ranks' together): wait for rank 0 to print it and exit, which makes torchrun stop this
    rank (exiting first would make torchrun stop rank 0 before it printed); should rank 0 not
    end the job within `wait_s` (it did not fail alike), print the message here after all.
    Ranks started some other way, each with its own output, print it at once."""
    import os
    import time

    from megatron_lora.runtime.watchdog import under_torchrun

    if under_torchrun() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(wait_s)
    print(message, file=sys.stderr, flush=True)


def _run(args) -> int:
    """run_training with its user errors as one line (exit 2) and Ctrl-C as one line (exit
    130), printed once under torchrun: by rank 0, or by each rank for a problem of its own
    (every rank finds the same bad input before any collective)."""
    from megatron_lora.cli.run_config import resolved
    from megatron_lora.cli.train_run import TrainSetupError, run_training
    from megatron_lora.training.interrupt import TrainInterrupted
    from megatron_lora.training.loop import TrainingDiverged

    try:
        # resolved after the setup checks: --adapter replaces the LoRA flags with the adapter's
        return run_training(args, lambda: resolved(parser(), args))
    except TrainSetupError as exc:
        message = f"megatron-lora train: error: {exc}"
        if _rank0() or exc.every_rank:
            print(message, file=sys.stderr, flush=True)
        else:
            _leave_it_to_rank0(message)
        return 2
    except TrainInterrupted as exc:
        if _rank0():
            print(f"megatron-lora train: {exc}", file=sys.stderr, flush=True)
        return 130
    except TrainingDiverged as exc:  # the same values on every rank: rank 0 says it
        if _rank0():
            print(f"megatron-lora train: error: {exc}", file=sys.stderr, flush=True)
        return 1
