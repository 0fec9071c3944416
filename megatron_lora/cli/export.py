"""`megatron-lora export`: adapters and merged models out to the Hugging Face stack.

    megatron-lora export peft --adapter runs/lora --load-hf Mixtral-8x7B-v0.1 --save my-adapter
    megatron-lora export hf --load mixtral-mcore --adapter runs/lora --save Mixtral-merged

`export peft` writes a PEFT LoRA folder (adapter_model.safetensors + adapter_config.json, the
per-expert layout PEFT, transformers and vLLM load), or for a prefix-tuning run (train --peft-type
prefix) a PEFT PREFIX_TUNING folder; only config.json of --load-hf is read, no base weights. `export hf` writes the base model with the adapter merged in (fp32 merge, cast back to
the base dtype) as HF safetensors shards; merging is its only mode, so `--merge` may be given or
left out. Both run in one process, stream, create the output folder only when it is complete, and
print the iteration of the adapter checkpoint they exported.
"""

from __future__ import annotations

import os
import sys

from megatron_lora.cli.convert import HELP, parse_size


def register(sub) -> None:
    p = sub.add_parser("export", help="export adapters (PEFT) or merged models (HF safetensors)",
                       formatter_class=HELP)
    kinds = p.add_subparsers(dest="format", metavar="FORMAT", required=True)
    a = kinds.add_parser("peft", help="adapter checkpoint -> HF PEFT folder (LoRA, "
                         "per-expert; or PREFIX_TUNING)", formatter_class=HELP)
    a.add_argument("--adapter", required=True, help="adapter checkpoint: a run folder (newest "
                   "iteration) or an iter_* folder")
    a.add_argument("--load-hf", required=True, help="the base model's HF folder or config.json "
                   "(only config.json is read)")
    a.add_argument("--save", required=True, help="output PEFT folder (must not exist)")
    a.add_argument("--allow-other-base", action="store_true", help="export an --adapter recorded "
                   "as trained on another base model (another family or other sizes)")
    a.add_argument("--base-model-name", default=None,
                   help="base_model_name_or_path written to adapter_config.json (None: the "
                   "--load-hf path)")
    b = kinds.add_parser("hf", help="base checkpoint + adapter -> merged HF safetensors",
                         formatter_class=HELP)
    b.add_argument("--load", required=True, help="base megatron-core torch_dist checkpoint")
    b.add_argument("--hf-config", default=None,
                   help="HF config.json of the model (default: the one hf-to-mcore stored)")
    b.add_argument("--adapter", required=True, help="adapter checkpoint (run or iter_* folder)")
    b.add_argument("--merge", action="store_true", default=True,
                   help="merge the adapter into the weights: the default and only mode (the flag "
                   "is accepted, not needed)")
    b.add_argument("--save", required=True, help="output HF folder (must not exist)")
    b.add_argument("--allow-other-base", action="store_true", help="merge an --adapter recorded "
                   "as trained on another base model (another family or other sizes)")
    b.add_argument("--max-shard-size", type=parse_size, default="5GB",
                   help="largest safetensors file, e.g. 5GB, 500MB, 2GiB")
    b.add_argument("--no-progress", action="store_true", help="no progress bar (it shows bytes "
                   "written, on stderr)")
    for q in (a, b):
        q.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from megatron_lora.convert.errors import ConversionError
    from megatron_lora.families import ModelConfigError

    try:
        if args.format == "peft":
            from megatron_lora.export.to_peft import export_peft

            notes = []
            base_model = args.base_model_name
            if base_model is None:  # the --load-hf folder, as the flag's help says
                base_model = args.load_hf
                if os.path.basename(base_model) == "config.json":
                    base_model = os.path.dirname(base_model) or "."
            config = export_peft(args.adapter, args.save, hf_config=args.load_hf,
                                 overwrite=args.overwrite, base_model=base_model, notes=notes,
                                 allow_other_base=args.allow_other_base)
            for note in notes:
                print(f"note: {note}", file=sys.stderr)
            if config["peft_type"] == "PREFIX_TUNING":
                print(f"PREFIX_TUNING: num_virtual_tokens={config['num_virtual_tokens']}, "
                      f"num_layers={config['num_layers']}, token_dim={config['token_dim']}, "
                      f"prefix_projection={config['prefix_projection']}", file=sys.stderr)
            else:
                print(f"target_modules {config['target_modules']}, r={config['r']}, "
                      f"lora_alpha={config['lora_alpha']}, rank_pattern="
                      f"{config['rank_pattern']}, alpha_pattern={config['alpha_pattern']}",
                      file=sys.stderr)
        else:
            from megatron_lora.export.merged import export_merged_hf

            export_merged_hf(args.load, args.adapter, args.save, hf_config=args.hf_config,
                             max_shard_bytes=args.max_shard_size, overwrite=args.overwrite,
                             progress=not args.no_progress,
                             allow_other_base=args.allow_other_base)
        exported = _adapter_iteration(args.adapter)  # read and checked by the export already
        if trained_on_nf4(args.adapter):
            print(f"note: {NF4_NOTES[args.format]}", file=sys.stderr)
    except (ConversionError, ModelConfigError) as exc:
        print(f"megatron-lora export {args.format}: error: {exc}", file=sys.stderr)
        return 2
    print(f"exported iteration {exported[0]} of {args.adapter} ({exported[1]})", file=sys.stderr)
    print(f"wrote {args.save}", file=sys.stderr)
    return 0


NF4_NOTES = {
    "peft": "the adapter was trained on an NF4 base (--base-quantization nf4); it is an "
            "ordinary PEFT LoRA adapter: load it onto the base model, or onto its NF4 form "
            "(bitsandbytes' 4-bit NF4, blocksize 64, double quantisation) for the values it "
            "was trained with",
    "hf": "the adapter was trained on an NF4 base (--base-quantization nf4); it was merged onto "
          "the full-precision base weights of --load, not onto their NF4 form",
}


def trained_on_nf4(path: str) -> bool:
    """Whether the adapter checkpoint's run used --base-quantization nf4 (its saved run config;
    checkpoints without one, e.g. from import peft, say no)."""
    from megatron_lora.cli.quantization import saved_base_quantization

    return saved_base_quantization(path) == "nf4"


def _adapter_iteration(path: str):
    """(iteration, iteration folder) of the adapter checkpoint `path` (a run folder: its newest);
    ConversionError naming --adapter if it is not one."""
    from megatron_lora.convert.errors import ConversionError
    from megatron_lora.runtime.safe_load import CheckpointFileError
    from megatron_lora.training.checkpoint import read_run_metadata, resolve

    try:
        directory = resolve(path)
        return read_run_metadata(directory).get("iteration"), directory
    except (OSError, ValueError, CheckpointFileError) as exc:
        raise ConversionError(f"--adapter: {exc}") from None
