"""`megatron-lora logits` and `generate` computed in the warm multi-rank world.

A torchrun launch of either command starts fresh processes that import torch, megatron-core and
transformers for a few milliseconds of work. `logits(argv)` and `generate(argv)` take the same
command line (without the command name), parse it with the CLI's own parser, and run what the
command runs - open_model_source's checks, the adapter checkpoint's LoraConfig, build_model with
the base weights and the adapter, forward_logits / inference.generate - on the ranks of the
reused world of `world_size` ranks, initialised for the layout the flags give. The output file is
the command's (safetensors `logits` [B, S, V] fp32; JSONL rows with `completion` and
`token_ids`), written by one rank. The commands themselves, with their argument checks and
launch, are run as commands elsewhere (tests/export/test_generate.py, test_trained.py,
test_peft_made.py and tests/cli).
"""

import json

import torch

from tests.harness import multirank


def parse(command: str, argv) -> object:
    """The argparse namespace `megatron-lora COMMAND ARGV` gets."""
    from megatron_lora.cli import build_parser

    return build_parser().parse_args([command, *argv])


def layout_of(command: str, argv):
    """The ParallelLayout the command's layout flags in `argv` give."""
    from megatron_lora.cli.common import layout_from_args

    return layout_from_args(parse(command, argv))


def _model(args, layout, attention_backend):
    """(this rank's model with the adapter, ModelInfo, LoraConfig or None), as the commands
    build it; every check local to the rank, before the first collective."""
    import torch.distributed as dist

    from megatron_lora.cli.model_setup import build_model, open_model_source
    from megatron_lora.lora.trainable_tokens import info_for_tokens

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    info, hf = open_model_source(args, layout, dist.get_world_size(), dtype)
    lora = None
    if args.adapter:
        from megatron_lora.export.adapter_ckpt import AdapterCheckpoint

        lora = AdapterCheckpoint(args.adapter, info).config
        info = info_for_tokens(info, lora.trainable_token_indices, load=args.load)
    model = build_model(info, layout, dtype, hf=hf, load=args.load, adapter=args.adapter,
                        lora=lora, attention_backend=attention_backend,
                        moe_grouped_gemm=args.moe_grouped_gemm,
                        dispatcher=args.moe_token_dispatcher_type,
                        base_quantization=args.base_quantization)
    return model, info, lora


@multirank(world_size=lambda world_size, **_: world_size, timeout=600)
def _logits(layout, world_size, argv):
    from safetensors.torch import save_file

    from megatron_lora import runtime
    from megatron_lora.cli.logits import read_tokens
    from megatron_lora.convert.logits import forward_logits
    from megatron_lora.lora.trainable_tokens import served_vocab

    args = parse("logits", argv)
    model, info, lora = _model(args, layout, args.attention_backend)
    vocab = served_vocab(info.vocab_size, lora)
    tokens = read_tokens(args.tokens, vocab)
    out = forward_logits(model, tokens.to(runtime.device()), vocab,
                         micro_batch_size=args.micro_batch_size)
    if out is not None:
        save_file({"logits": out.float().cpu().contiguous()}, args.out)


@multirank(world_size=lambda world_size, **_: world_size, timeout=600)
def _generate(layout, world_size, argv):
    import torch.distributed as dist

    from megatron_lora.cli.generate import _sampling
    from megatron_lora.data.tokenizers import load_tokenizer
    from megatron_lora.inference import generate
    from megatron_lora.inference.prompts import prompt_ids, read_prompts
    from megatron_lora.lora.trainable_tokens import served_vocab

    args = parse("generate", argv)
    sampling = _sampling(args)
    tokenizer = load_tokenizer(args.tokenizer or args.load_hf)
    records = read_prompts(args.prompts)
    prompts = [prompt_ids(tokenizer, r, f"{args.prompts}:{i + 1}") for i, r in enumerate(records)]
    model, info, lora = _model(args, layout, "flash")  # the command's SDPA core attention
    generator = torch.Generator().manual_seed(sampling.seed)
    rows = []
    for record, ids in zip(records, prompts):
        new = generate(model, ids, sampling, eos_id=tokenizer.eos_id,
                       vocab_size=served_vocab(info.vocab_size, lora), generator=generator)
        rows.append(dict(record, completion=tokenizer.decode(new), token_ids=new))
    if dist.get_rank() == 0:
        with open(args.out, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def logits(argv, world_size: int = 2) -> None:
    """`megatron-lora logits ARGV` on `world_size` ranks of the warm world."""
    _logits(layout=layout_of("logits", argv), world_size=world_size, argv=list(argv))


def generate(argv, world_size: int = 2) -> None:
    """`megatron-lora generate ARGV` on `world_size` ranks of the warm world."""
    _generate(layout=layout_of("generate", argv), world_size=world_size, argv=list(argv))
