"""`megatron-lora generate`: text from a model (with a LoRA adapter) at any parallel layout.

    torchrun --nproc-per-node 4 -m megatron_lora generate --load-hf Mixtral-8x7B-v0.1 \\
        --adapter runs/lora --tensor-model-parallel-size 2 --expert-model-parallel-size 2 \\
        --sequence-parallel --prompts prompts.jsonl --max-new-tokens 128 --out out.jsonl

--prompts: JSONL, {"prompt": text} or {"messages": [...]} (the tokenizer's chat template) per
line. --out (default `-`: stdout, from rank 0): JSONL, one object per prompt: its fields plus
"completion" (the decoded new text, special tokens dropped) and "token_ids" (the generated ids,
with the EOS id when generation stopped there, as transformers' generate returns them). Greedy
by default (--temperature 0); with --temperature > 0 tokens are drawn (--top-k, --top-p, --seed). A KV cache keeps the time per
token flat as the output grows (megatron_lora.inference.generate). Every input is checked on
every rank before the first collective.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from megatron_lora.cli.common import add_layout_args, layout_from_args
from megatron_lora.cli.quantization import add_quantization_arg


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text with a model and adapter (torchrun)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       allow_abbrev=False)  # as Megatron-LM: a mistyped flag is an error
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--load", help="megatron-core torch_dist checkpoint (from convert "
                     "hf-to-mcore)")
    src.add_argument("--load-hf", help="HF model folder, read directly (each rank its slices)")
    p.add_argument("--hf-config", default=None, help="config.json for a --load checkpoint that "
                   "has no hf_config.json of its own")
    p.add_argument("--adapter", default=None, help="LoRA adapter checkpoint of `train` or "
                   "`import peft` (run folder or iter_* folder), applied on the base weights")
    p.add_argument("--allow-other-base", action="store_true", help="apply an --adapter recorded "
                   "as trained on another base model (another family or other sizes)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json, an HF folder with one, or "
                   "'byte' (default: the --load-hf folder)")
    p.add_argument("--prompts", required=True, help="JSONL: {\"prompt\": text} or "
                   "{\"messages\": [...]} per line")
    p.add_argument("--out", default="-", help="output JSONL: each prompt's fields plus "
                   "'completion' and 'token_ids'; '-' (the default): printed to stdout")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most "
                   "per prompt (fewer when the tokenizer's EOS comes first)")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (argmax); else "
                   "sample from softmax(logits / temperature)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens "
                   "(0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely "
                   "tokens whose probabilities sum to top-p (1: all)")
    g.add_argument("--seed", type=int, default=1234, help="seed of the sampling generator")
    add_layout_args(p)
    p.add_argument("--bf16", action="store_true", help="run the model in bf16 (default fp32)")
    p.add_argument("--moe-grouped-gemm", action=argparse.BooleanOptionalAction, default=None,
                   help="grouped experts (GroupedExperts; default: on CUDA GPUs, off on CPU)")
    add_quantization_arg(p)
    p.set_defaults(func=_run)


def _fail(message: str) -> int:
    from megatron_lora.cli.common import error_once

    error_once(f"megatron-lora generate: error: {message}")  # every rank found it: said once
    return 2


def _sampling(args):
    from megatron_lora.inference import SamplingConfig

    try:
        return SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as exc:  # the config names its field; the user typed the flag
        field = str(exc).split(" ", 1)[0]
        raise ValueError(f"--{field.replace('_', '-')}{str(exc)[len(field):]}") from None


def _run(args) -> int:
    import torch

    from megatron_lora.convert.errors import ConversionError
    from megatron_lora.data.tokenizers import TokenizerError, load_tokenizer
    from megatron_lora.inference.prompts import PromptError, prompt_ids, read_prompts
    from megatron_lora.families import ModelConfigError
    from megatron_lora.runtime import LayoutError

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    try:  # everything below is local to this rank: no collective yet
        sampling = _sampling(args)
        layout = layout_from_args(args)
        from megatron_lora.cli.model_setup import open_model_source

        info, hf = open_model_source(args, layout, world_size, dtype)
        spec = args.tokenizer or args.load_hf
        if spec is None:
            return _fail("--tokenizer is needed with --load (tokenizer.json, an HF folder with "
                         "one, or 'byte')")
        tokenizer = load_tokenizer(spec)
        records = read_prompts(args.prompts)
        prompts = [prompt_ids(tokenizer, r, f"{args.prompts}:{i + 1}")
                   for i, r in enumerate(records)]
        lora = None
        if args.adapter:
            from megatron_lora.export.adapter_ckpt import AdapterCheckpoint

            lora = AdapterCheckpoint(args.adapter, info,  # checks its base, every factor's shape
                                     args.allow_other_base).config
            from megatron_lora.lora.trainable_tokens import info_for_tokens

            info = info_for_tokens(info, lora.trainable_token_indices, load=args.load)
        _check_prompts(prompts, args, info, tokenizer, lora)
        from megatron_lora.convert.outputs import check_output

        if args.out != "-":
            check_output(args.out, kind="file", overwrite=args.overwrite, flag="--out", inputs={
                "--load": args.load, "--load-hf": args.load_hf, "--hf-config": args.hf_config,
                "--adapter": args.adapter, "--prompts": args.prompts,
                "--tokenizer": args.tokenizer})
    except (ConversionError, ModelConfigError, LayoutError, TokenizerError, PromptError,
            ValueError) as exc:
        return _fail(str(exc))
    return _generate_all(args, layout, info, hf, dtype, lora, tokenizer, records, prompts,
                         sampling)


def _check_prompts(prompts, args, info, tokenizer, lora=None) -> None:
    from megatron_lora.inference.prompts import PromptError
    from megatron_lora.lora.trainable_tokens import served_vocab

    limit = info.shape.max_position_embeddings
    vocab = served_vocab(info.vocab_size, lora)  # + the adapter's trained new tokens
    for i, ids in enumerate(prompts):
        where = f"{args.prompts}:{i + 1}"
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise PromptError(f"{where}: token id {bad} from --tokenizer {tokenizer.name} must "
                              f"satisfy 0 <= id < {vocab} (the model's vocabulary): "
                              f"is it the model's tokenizer?")
        if len(ids) + args.max_new_tokens > limit:
            raise PromptError(f"{where}: {len(ids)} prompt tokens + --max-new-tokens "
                              f"{args.max_new_tokens} exceed the model's "
                              f"max_position_embeddings={limit}")


def _generate_all(args, layout, info, hf, dtype, lora, tokenizer, records, prompts,
                  sampling) -> int:
    import torch
    import torch.distributed as dist

    from megatron_lora import runtime
    from megatron_lora.cli.common import torchrun_env_defaults
    from megatron_lora.cli.model_setup import build_model
    from megatron_lora.inference import generate
    from megatron_lora.lora.trainable_tokens import served_vocab

    torchrun_env_defaults(29519)
    runtime.init_process_group()
    runtime.initialize(layout, model_sizes=info.shape.layout_sizes())
    # The SDPA core attention takes a multi-token step against the cache (sequence parallelism
    # pads each step to a multiple of tp tokens).
    model = build_model(info, layout, dtype, hf=hf, load=args.load, adapter=args.adapter,
                        lora=lora, attention_backend="flash",
                        moe_grouped_gemm=args.moe_grouped_gemm,
                        dispatcher=args.moe_token_dispatcher_type,
                        base_quantization=args.base_quantization)
    generator = torch.Generator().manual_seed(sampling.seed)
    results, new_tokens, start = [], 0, time.perf_counter()
    for record, ids in zip(records, prompts):
        out = generate(model, ids, sampling, eos_id=tokenizer.eos_id,
                       vocab_size=served_vocab(info.vocab_size, lora), generator=generator)
        new_tokens += len(out)
        results.append(dict(record, completion=tokenizer.decode(out), token_ids=out))
    seconds = time.perf_counter() - start
    if dist.get_rank() == 0:
        import json

        from megatron_lora.convert.atomic import atomic_file

        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
        if args.out == "-":
            out_path = "stdout"
            sys.stdout.write(lines)
            sys.stdout.flush()
        else:
            out_path = os.path.abspath(args.out)
            with atomic_file(out_path) as tmp:  # --out was checked before the first collective
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(lines)
        print(f"generated {new_tokens} tokens for {len(results)} prompts in {seconds:.1f} s "
              f"({1000.0 * seconds / max(new_tokens, 1):.1f} ms per token, {layout.describe()} "
              f"on {dist.get_world_size()} ranks); wrote {out_path}", file=sys.stderr)
    dist.barrier()
    runtime.shutdown()
    return 0
