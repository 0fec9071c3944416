"""`megatron-lora convert`: Hugging Face safetensors (any family) <-> megatron-core torch_dist.

    megatron-lora convert hf-to-mcore --hf-dir Mixtral-8x7B --save mixtral-mcore
    megatron-lora convert mcore-to-hf --load mixtral-mcore --save Mixtral-8x7B-out

Both run in one process with bounded memory (streamed, tensor by tensor), show a progress bar in
bytes, and create the output directory only when it is complete. The torch_dist checkpoint loads
at any TP/PP/EP/ETP layout (`megatron-lora logits --load ...`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

HELP = argparse.ArgumentDefaultsHelpFormatter  # every flag's --help line shows its default


def parse_size(text: str) -> int:
    """'5GB', '500MB', '100KB', '123' (bytes) -> bytes (powers of 1000, 'GiB' etc. of 1024)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"cannot parse size {text!r}; use e.g. 5GB, 500MB, 2GiB or a byte count")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))


def register(sub) -> None:
    p = sub.add_parser("convert", help="convert checkpoints: HF safetensors <-> megatron-core",
                       formatter_class=HELP)
    conv = p.add_subparsers(dest="direction", metavar="DIRECTION", required=True)
    a = conv.add_parser("hf-to-mcore", help="HF model -> torch_dist checkpoint (any layout)",
                        formatter_class=HELP)
    a.add_argument("--hf-dir", required=True, help="HF model folder (config.json + safetensors)")
    a.add_argument("--save", required=True, help="output checkpoint folder (must not exist)")
    b = conv.add_parser("mcore-to-hf", help="torch_dist checkpoint -> HF safetensors shards",
                        formatter_class=HELP)
    b.add_argument("--load", required=True, help="megatron-core torch_dist checkpoint folder of "
                   "a base model (from hf-to-mcore); an adapter checkpoint is merged into its "
                   "base with `export hf` instead")
    b.add_argument("--save", required=True, help="output HF folder (must not exist)")
    b.add_argument("--hf-config", default=None,
                   help="HF config.json of the model (default: the one hf-to-mcore stored)")
    b.add_argument("--max-shard-size", type=parse_size, default="5GB",
                   help="largest safetensors file, e.g. 5GB, 500MB, 2GiB")
    for q in (a, b):
        q.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
        q.add_argument("--no-progress", action="store_true", help="no progress bar (it shows "
                       "bytes written, on stderr)")
    p.set_defaults(func=_run)


def is_adapter_checkpoint(path: str) -> bool:
    """Whether `path` is a run folder (it has a checkpoint tracker) or an iteration folder of an
    adapter checkpoint (common state with run_metadata.lora) rather than a base checkpoint."""
    from megatron_lora.training.checkpoint import TRACKER, read_run_metadata

    if os.path.isfile(os.path.join(path, TRACKER)):
        return True
    if not os.path.isfile(os.path.join(path, "metadata.json")) or os.path.isfile(
            os.path.join(path, "megatron_lora.json")):
        return False
    try:
        return (read_run_metadata(path).get("run_metadata") or {}).get("lora") is not None
    except Exception:  # unreadable common state: not recognisably ours; mcore_to_hf reports it
        return False


def _run(args) -> int:
    from megatron_lora.convert.errors import ConversionError
    from megatron_lora.families import ModelConfigError

    try:
        if args.direction == "hf-to-mcore":
            from megatron_lora.convert.hf_to_mcore import hf_to_mcore

            hf_to_mcore(args.hf_dir, args.save, overwrite=args.overwrite,
                        progress=not args.no_progress)
        else:
            from megatron_lora.convert.mcore_to_hf import mcore_to_hf

            if is_adapter_checkpoint(args.load):
                raise ConversionError(
                    f"--load {args.load} is an adapter checkpoint (from `megatron-lora train` or "
                    f"`import peft`), not a base model. To write the base model with this adapter "
                    f"merged in as HF safetensors: megatron-lora export hf --load BASE_MCORE "
                    f"--adapter {args.load} --save OUT (--merge is the default); for the adapter "
                    f"alone in PEFT format: megatron-lora export peft --adapter {args.load} "
                    f"--load-hf BASE_HF --save OUT")

            mcore_to_hf(args.load, args.save, hf_config=args.hf_config,
                        max_shard_bytes=args.max_shard_size,
                        overwrite=args.overwrite, progress=not args.no_progress)
    except (ConversionError, ModelConfigError) as exc:
        print(f"megatron-lora convert {args.direction}: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.save}", file=sys.stderr)
    return 0
