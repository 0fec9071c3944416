"""This rank's model stage with its weights (and an adapter), for the inference commands."""

from __future__ import annotations

import sys
from typing import Optional


def open_model_source(args, layout, world_size: int, dtype):
    """(ModelInfo, HFCheckpoint or None) of --load-hf / --load (+ --hf-config), with the layout
    checked against the model (flags named) and the config against the checkpoint and the memory
    per rank. Local to this rank (no collective); raises the errors the commands report."""
    from megatron_lora.convert.checks import check_before_build

    if args.load_hf:
        from megatron_lora.convert.hf_to_mcore import open_hf

        info, hf, _ = open_hf(args.load_hf)
    else:
        from megatron_lora.convert.hf_to_mcore import read_mcore_info

        info, hf = read_mcore_info(args.load, args.hf_config), None
    info.validate_layout(layout, world_size, flags=True)
    check_before_build(info, layout, dtype, load=args.load, hf_config=args.hf_config)
    from megatron_lora.cli.quantization import quantization_problems

    problems = quantization_problems(args, info, layout)
    if problems:
        raise ValueError("; ".join(problems))
    return info, hf


def build_model(info, layout, dtype, *, hf=None, load: Optional[str] = None,
                adapter: Optional[str] = None, lora=None, attention_backend: Optional[str] = None,
                moe_grouped_gemm: Optional[bool] = None, dispatcher: str = "allgather",
                base_quantization: str = "none"):
    """The GPTModel of this pipeline stage on this rank's device, weights from HF safetensors
    (`hf`, an HFCheckpoint) or a torch_dist checkpoint (`load`), then, with `lora` (the adapter
    checkpoint's LoraConfig), apply_lora and the factors of `adapter`. Megatron's parallel state
    must be initialised for `layout`.

    attention_backend / moe_grouped_gemm: as the CLI flags; a named local core attention or
    grouped experts mean the local layers, otherwise the usual choice of build_model.
    base_quantization: "nf4" holds the decoder linears in NF4 (cli/quantization.py), each as it
    is loaded (build_base), before the adapter is applied."""
    from megatron_lora.models.build import model_config

    local = (attention_backend not in (None, "auto") or bool(moe_grouped_gemm)
             or base_quantization == "nf4")
    model = build_base(info, model_config(info, layout, dtype=dtype, dispatcher=dispatcher),
                       hf=hf, load=load, base_quantization=base_quantization,
                       use_te=False if local else None, attention_backend=attention_backend,
                       moe_grouped_gemm=moe_grouped_gemm)
    if lora is not None:
        from megatron_lora.lora.model import apply_lora
        from megatron_lora.training.checkpoint import load_adapter_weights

        apply_lora(model, lora, verbose=False)
        load_adapter_weights([model], adapter)
    return model


def build_base(info, config, *, hf=None, load: Optional[str] = None,
               base_quantization: str = "none", **build):
    """This pipeline stage's GPTModel (models.build.build_model(info, config, **build)) on this
    rank's device with its base weights from `hf` (an HFCheckpoint) or the torch_dist checkpoint
    `load`. Collective (a torch_dist load; NF4's gathers).

    base_quantization "nf4": the decoder linears are built without their weights
    (models/nf4_deferred.py) and each is held in NF4 as it is read (convert/load_nf4.py), so the
    rank's peak is its packed model plus its other tensors plus about one linear's full-precision
    weight, never its whole full-precision model. The values are those of loading in full
    precision and then quantize_base. A ConversionError while reading (a NaN weight, a bad FP8
    scale: convert/finite.py) exits this rank with status 2 and its one-line message."""
    from megatron_lora.convert.errors import ConversionError

    try:
        return _build_base(info, config, hf, load, base_quantization, build)
    except ConversionError as exc:  # a bad tensor found as it is read (a NaN weight, a bad
        # scale) on the rank that reads it; torchrun then stops the others
        print(f"megatron-lora: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _build_base(info, config, hf, load, base_quantization: str, build: dict):
    from megatron_lora import runtime
    from megatron_lora.models.build import build_model
    from megatron_lora.models.describe import announce

    if base_quantization != "nf4":
        from megatron_lora.convert.load import load_hf, load_mcore

        model = build_model(info, config, **build)
        model.to(runtime.device())
        announce(model)
        if hf is not None:
            load_hf(model, info, hf)
        else:
            load_mcore(model, load)
        return model
    from megatron_lora.convert.load_nf4 import load_nf4
    from megatron_lora.models.nf4_deferred import deferred_decoder_linears, to_device_

    with deferred_decoder_linears():
        model = build_model(info, config, **build)
    to_device_(model, runtime.device())
    announce(model)
    load_nf4(model, info, hf=hf, directory=None if hf is not None else load)
    return model
