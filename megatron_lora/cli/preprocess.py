"""`megatron-lora preprocess`: JSONL training data -> a megatron-core indexed dataset prefix.

    megatron-lora preprocess --input train.jsonl --tokenizer Mixtral-8x7B-v0.1 \\
        --output-prefix data/train --workers 8

Writes data/train.bin/.idx (token ids, Megatron-LM's format), data/train_targets.bin/.idx (loss
masks) and data/train.json (data/preprocess.py), which `train --data-path data/train` reads
memory-mapped. The samples are exactly those `train` makes of the JSONL lines. One process plus
--workers tokenizing processes; no torch.distributed.
"""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser(
        "preprocess", help="tokenize JSONL into a megatron-core indexed dataset (.bin/.idx)",
        allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Tokenize JSONL training data (text, prompt/response or messages lines) "
        "into megatron-core indexed datasets at --output-prefix: PREFIX.bin/.idx (token ids), "
        "PREFIX_targets.bin/.idx (loss masks), PREFIX.json; train --data-path PREFIX reads "
        "them.")
    p.add_argument("--input", required=True, nargs="+", metavar="FILE",
                   help="JSONL file(s), read in the order given")
    p.add_argument("--tokenizer", required=True, help="'byte', a tokenizer.json, or an HF "
                   "tokenizer folder (its chat template renders 'messages'); give train the same")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX",
                   help="output path without extension")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="tokenizing processes; the output does not depend on it")
    p.add_argument("--chunk-lines", type=int, default=256, metavar="N",
                   help="lines per unit of work")
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="skip malformed lines (counted and reported) instead of stopping at the "
                   "first one")
    p.add_argument("--overwrite", action="store_true", help="replace an existing prefix")
    p.add_argument("--log-interval", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between progress lines on stderr (negative: none)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from megatron_lora.data.preprocess import PreprocessError, preprocess
    from megatron_lora.data.tokenizers import TokenizerError

    try:
        stats = preprocess(args.input, args.tokenizer, args.output_prefix, workers=args.workers,
                           skip_bad_lines=args.skip_bad_lines, overwrite=args.overwrite,
                           chunk_lines=args.chunk_lines, progress_interval=args.log_interval)
    except (PreprocessError, TokenizerError, FileNotFoundError) as exc:
        print(f"megatron-lora preprocess: error: {exc}", file=sys.stderr)
        return 2
    for message in stats.skipped[:10]:
        print(f"skipped: {message}", file=sys.stderr)
    if len(stats.skipped) > 10:
        print(f"skipped: ... and {len(stats.skipped) - 10} more", file=sys.stderr)
    rate = stats.tokens / stats.seconds if stats.seconds else float("inf")
    print(f"wrote {args.output_prefix}.bin/.idx and {args.output_prefix}_targets.bin/.idx: "
          f"{stats.samples} samples, {stats.tokens} tokens ({stats.trained_tokens} trained), "
          f"{len(stats.skipped)} bad lines skipped, in {stats.seconds:.1f} s ({rate:.0f} "
          f"tokens/s, {args.workers} workers)")
    return 0
