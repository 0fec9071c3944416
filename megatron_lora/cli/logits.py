"""`megatron-lora logits`: a model's logits for given token ids, at any parallel layout.

    torchrun --nproc-per-node 4 -m megatron_lora logits --load mixtral-mcore \\
        --tensor-model-parallel-size 2 --expert-model-parallel-size 2 --sequence-parallel \\
        --tokens tokens.json --out logits.safetensors

--tokens: a JSON list of token-id lists of equal length. --out: safetensors with one tensor
`logits` [batch, seq, vocab] fp32 (vocab = config.json's vocab_size, padding dropped), written by
one rank, through a temporary file renamed into place (an existing --out file is replaced only
with --overwrite; a folder, an input or an unwritable location is refused up front). Weights
come from a torch_dist checkpoint (--load) or straight from HF safetensors
(--load-hf, each rank reading only its own slices). --adapter adds a LoRA adapter checkpoint (from
`megatron-lora train` or `import peft`, saved at any layout): apply_lora with the checkpoint's
LoraConfig, then its factors are loaded. Every input and the layout are checked on every rank
before the first collective, so a bad run fails fast on all ranks with one message.
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_lora.cli.common import add_layout_args, layout_from_args
from megatron_lora.cli.quantization import add_quantization_arg
from megatron_lora.cli.convert import HELP


def register(sub) -> None:
    p = sub.add_parser("logits", help="logits of a checkpoint for given tokens (torchrun)",
                       formatter_class=HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", help="megatron-core torch_dist checkpoint (from convert hf-to-mcore)")
    src.add_argument("--load-hf", help="HF model folder, read directly (no conversion)")
    p.add_argument("--hf-config", default=None, help="config.json for a --load checkpoint that "
                   "has no hf_config.json of its own")
    p.add_argument("--adapter", default=None, help="LoRA adapter checkpoint (run folder or "
                   "iter_* folder) applied on top of the base weights")
    p.add_argument("--allow-other-base", action="store_true", help="apply an --adapter recorded "
                   "as trained on another base model (another family or other sizes)")
    p.add_argument("--tokens", required=True, help="JSON list of equal-length token-id lists")
    p.add_argument("--out", required=True, help="output .safetensors (tensor 'logits', fp32)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    add_layout_args(p)
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per forward on "
                   "each data-parallel rank (the batch must divide by it times the DP size)")
    p.add_argument("--bf16", action="store_true", help="run the model in bf16 (default fp32)")
    p.add_argument("--attention-backend", choices=["flash", "fused", "unfused", "local", "auto"],
                   default=None, help="core attention (Megatron-LM's names): 'flash' torch's "
                   "fused scaled_dot_product_attention, 'unfused'/'local' megatron's "
                   "DotProductAttention, both on the local layers; default: the layers' own")
    p.add_argument("--moe-grouped-gemm", action=argparse.BooleanOptionalAction, default=None,
                   help="grouped experts (GroupedExperts, the same checkpoints as SequentialMLP, "
                   "which --no-moe-grouped-gemm selects); default: on with the local layers on "
                   "CUDA GPUs, off on CPU")
    add_quantization_arg(p)
    p.set_defaults(func=_run)


def read_tokens(path: str, vocab_size: int):
    """[B, S] int64 tensor from a JSON list of equal-length lists of ids, 0 <= id < vocab_size."""
    import torch

    from megatron_lora.convert.errors import ConversionError
    from megatron_lora.jsonfile import json_value, read_json

    rows = read_json(path, ConversionError)
    if (not isinstance(rows, list) or not rows or
            not all(isinstance(r, list) and r and all(type(t) is int for t in r) for r in rows)):
        raise ConversionError(f"{path}: expected a non-empty JSON list of non-empty lists of ints")
    if len({len(r) for r in rows}) != 1:
        raise ConversionError(f"{path}: sequences have different lengths {sorted({len(r) for r in rows})}")
    bad = next(((i, j, t) for i, r in enumerate(rows) for j, t in enumerate(r)
                if not 0 <= t < vocab_size), None)  # checked before int64 conversion overflows
    if bad is not None:
        raise ConversionError(f"{path}: token id [{bad[0]}][{bad[1]}] = {json_value(bad[2])} is "
                              f"outside the model's vocabulary: ids must satisfy "
                              f"0 <= id < {vocab_size}")
    return torch.tensor(rows, dtype=torch.int64, device="cpu")


def _check_batch(tokens, layout, world_size: int, micro_batch_size: int, info) -> None:
    from megatron_lora.convert.errors import ConversionError

    b, s = tokens.shape
    dp = layout.data_parallel_size(world_size)
    if b % (dp * micro_batch_size):
        raise ConversionError(f"batch {b} is not divisible by data-parallel size {dp} x "
                              f"micro-batch size {micro_batch_size}")
    if layout.sp and s % layout.tp:
        raise ConversionError(f"sequence length {s} is not divisible by tp={layout.tp} "
                              f"(needed by --sequence-parallel)")
    if s > info.shape.max_position_embeddings:
        raise ConversionError(f"sequence length {s} exceeds max_position_embeddings="
                              f"{info.shape.max_position_embeddings}")


def _run(args) -> int:
    import torch

    from megatron_lora.convert.errors import ConversionError
    from megatron_lora.families import ModelConfigError
    from megatron_lora.runtime import LayoutError

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    from megatron_lora.models.specs import core_attention_class

    try:
        core_attention_class(args.attention_backend)
    except ValueError as exc:
        print(f"megatron-lora logits: error: --attention-backend: {exc}", file=sys.stderr)
        return 2
    try:  # everything below is local to this rank: no collective yet
        layout = layout_from_args(args)
        from megatron_lora.cli.model_setup import open_model_source

        info, hf = open_model_source(args, layout, world_size,
                                     torch.bfloat16 if args.bf16 else torch.float32)
        lora = None
        if args.adapter:
            from megatron_lora.export.adapter_ckpt import AdapterCheckpoint

            lora = AdapterCheckpoint(args.adapter, info,  # checks its base, every factor's shape
                                     args.allow_other_base).config
        from megatron_lora.lora.trainable_tokens import info_for_tokens, served_vocab

        if lora is not None:  # trained new tokens past the padded rows: a grown vocabulary
            info = info_for_tokens(info, lora.trainable_token_indices, load=args.load)
        tokens = read_tokens(args.tokens, served_vocab(info.vocab_size, lora))  # + new tokens
        _check_batch(tokens, layout, world_size, args.micro_batch_size, info)
        from megatron_lora.convert.outputs import check_output

        check_output(args.out, kind="file", overwrite=args.overwrite, flag="--out", inputs={
            "--load": args.load, "--load-hf": args.load_hf, "--hf-config": args.hf_config,
            "--adapter": args.adapter, "--tokens": args.tokens})
    except (ConversionError, ModelConfigError, LayoutError, ValueError) as exc:
        from megatron_lora.cli.common import error_once

        error_once(f"megatron-lora logits: error: {exc}")  # every rank found it: said once
        return 2
    return _compute(args, layout, info, hf, tokens, torch.bfloat16 if args.bf16 else torch.float32,
                    lora)


def _compute(args, layout, info, hf, tokens, dtype, lora=None) -> int:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from megatron_lora import runtime
    from megatron_lora.cli.model_setup import build_model
    from megatron_lora.convert.logits import forward_logits

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29518")
    runtime.init_process_group()
    runtime.initialize(layout, model_sizes=info.shape.layout_sizes())
    model = build_model(info, layout, dtype, hf=hf, load=args.load, adapter=args.adapter,
                        lora=lora, attention_backend=getattr(args, "attention_backend", None),
                        moe_grouped_gemm=getattr(args, "moe_grouped_gemm", None),
                        dispatcher=args.moe_token_dispatcher_type,
                        base_quantization=args.base_quantization)
    from megatron_lora.lora.trainable_tokens import served_vocab

    logits = forward_logits(model, tokens.to(runtime.device()), served_vocab(info.vocab_size, lora),
                            micro_batch_size=args.micro_batch_size)
    if logits is not None:
        from megatron_lora.convert.atomic import atomic_file

        out = os.path.abspath(args.out)
        with atomic_file(out) as tmp:  # --out was checked before the first collective
            save_file({"logits": logits.float().cpu().contiguous()}, tmp)
        print(f"wrote logits {list(logits.shape)} to {out} "
              f"({layout.describe()} on {dist.get_world_size()} ranks)", file=sys.stderr)
    dist.barrier()
    runtime.shutdown()
    return 0
