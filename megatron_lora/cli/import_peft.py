"""`megatron-lora import peft`: a Hugging Face PEFT LoRA (or PREFIX_TUNING) -> adapter
checkpoint.

    megatron-lora import peft --adapter my-adapter --load-hf Mixtral-8x7B-v0.1 --save imported

Reads the per-expert layout and transformers 5's fused `target_parameters` layout. Separate
q/k/v (or w1/w3) adapters with different A are stacked losslessly (the rank adds up); the
resulting ranks are printed. The checkpoint loads at any layout (`logits --adapter`, `train` can
be pointed at it as an adapter, `export peft` gives the adapter back). A PREFIX_TUNING adapter
imports as its saved prefix table (prefix_projection=False; a PEFT save with prefix_projection
holds only the projected table, which a note says).
"""

from __future__ import annotations

import sys

from megatron_lora.cli.convert import HELP


def register(sub) -> None:
    p = sub.add_parser("import", help="import adapters from the Hugging Face stack",
                       formatter_class=HELP)
    kinds = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    a = kinds.add_parser("peft", help="HF PEFT LoRA or PREFIX_TUNING folder -> adapter checkpoint",
                         formatter_class=HELP)
    a.add_argument("--adapter", required=True, help="PEFT folder (adapter_config.json + "
                   "adapter_model.safetensors)")
    a.add_argument("--load-hf", required=True, help="the base model's HF folder or config.json "
                   "(only config.json is read)")
    a.add_argument("--save", required=True, help="output adapter checkpoint folder (must not exist)")
    a.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    a.add_argument("--verbose", action="store_true", help="list every stacked/padded adapter "
                   "(default: the first 10)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from megatron_lora.convert.errors import ConversionError
    from megatron_lora.export.from_peft import import_peft
    from megatron_lora.families import ModelConfigError

    try:
        report = import_peft(args.adapter, args.save, hf_config=args.load_hf,
                             overwrite=args.overwrite)
    except (ConversionError, ModelConfigError) as exc:
        print(f"megatron-lora import peft: error: {exc}", file=sys.stderr)
        return 2
    cfg = report["config"]
    if cfg.get("num_virtual_tokens"):
        print(f"prefix tuning: num_virtual_tokens={cfg['num_virtual_tokens']}, "
              f"prefix_projection={cfg['prefix_projection']}", file=sys.stderr)
    else:
        print(f"ranks: {report['ranks']} (r={cfg['r']}, rank_pattern={cfg['rank_pattern']}, "
              f"lora_alpha={cfg['lora_alpha']}, alpha_pattern={cfg['alpha_pattern']})",
              file=sys.stderr)
    notes = report["notes"]
    for note in notes if args.verbose else notes[:10]:
        print(f"  {note}", file=sys.stderr)
    if len(notes) > 10 and not args.verbose:
        print(f"  ... {len(notes) - 10} more (--verbose)", file=sys.stderr)
    print(f"wrote {args.save}", file=sys.stderr)
    return 0
