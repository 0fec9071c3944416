"""`--base-quantization` for train, logits and generate: the flag, its checks, and its effect.

    --base-quantization nf4   every frozen decoder linear held in NF4 (QLoRA's format), each
                              weight quantised as its global matrix after loading
                              (models/nf4_model.py); router, embeddings, output layer and norms
                              keep the base dtype. Adapters and their checkpoints are unchanged.

The checks are local (no collective): the model's widths against the layout (a shard must hold
whole blocks of 64 input columns; the message names the flag and the width), bitsandbytes
importable, and the local layers (Transformer Engine linears are not converted).
"""

from __future__ import annotations

from typing import List


def add_quantization_arg(p) -> None:
    p.add_argument("--base-quantization", choices=["none", "nf4"], default="none",
                   help="hold the frozen decoder linears (attention, experts, shared experts) "
                   "in NF4, QLoRA's 4-bit format (about 0.52 bytes per parameter; needs "
                   "bitsandbytes: pip install 'megatron-lora[qlora]'); router, embeddings, "
                   "output layer and norms keep the base dtype")


def nf4_requested(args) -> bool:
    return getattr(args, "base_quantization", "none") == "nf4"


def quantization_problems(args, info, layout) -> List[str]:
    """What keeps --base-quantization from working for this model and layout ([]: fine)."""
    if not nf4_requested(args):
        return []
    from megatron_lora.models.nf4 import NF4Unavailable, code_books
    from megatron_lora.models.nf4_model import nf4_layout_problems

    problems = nf4_layout_problems(info.shape, layout)
    if getattr(args, "transformer_impl", "local") != "local":
        problems.append("--base-quantization nf4 converts the local layers' linears; use "
                        "--transformer-impl local")
    try:
        code_books("cpu")
    except NF4Unavailable as exc:
        problems.append(str(exc))
    return problems


def quantize_if_requested(args, model) -> None:
    """After the base weights are loaded, before LoRA (collective within each linear's group)."""
    if nf4_requested(args):
        from megatron_lora.models.nf4_model import quantize_base

        quantize_base(model)
