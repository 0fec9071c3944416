"""`--base-quantization` for train, logits and generate: the flag, its checks, and its effect.

    --base-quantization nf4   every frozen decoder linear held in NF4 (QLoRA's format), each
                              weight quantised as its global matrix as it is loaded
                              (cli/model_setup.build_base, convert/load_nf4.py); router,
                              embeddings, output layer and norms keep the base dtype. Adapters
                              and their checkpoints are unchanged.

The checks are local (no collective): the model's widths against the layout (a shard must hold
whole blocks of 64 input columns; the message names the flag and the width), bitsandbytes
importable, the local layers (Transformer Engine linears are not converted), and, for a resume
of --save or a run starting from an --adapter checkpoint of ours, the base quantisation that
checkpoint's run used (its saved run config): an adapter trained on the NF4 base continues on it,
one trained on the full-precision base continues on that (`saved_quantization_problems`).
"""

from __future__ import annotations

from typing import List, Optional


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


def saved_base_quantization(path: str) -> Optional[str]:
    """The --base-quantization the run that wrote adapter checkpoint `path` (a run folder: its
    newest; or an iter_* folder) used, from its saved run config: "none" when that config
    predates the flag, None when there is no run config (e.g. `import peft`) or no readable
    checkpoint (the load reports that). Reads one file; no collective."""
    from megatron_lora.runtime.safe_load import CheckpointFileError
    from megatron_lora.training.checkpoint import read_run_metadata

    try:
        meta = read_run_metadata(path).get("run_metadata") or {}
    except (OSError, ValueError, CheckpointFileError):
        return None
    run = meta.get("run_config") if isinstance(meta, dict) else None
    if not isinstance(run, dict):
        return None
    return str(run.get("base-quantization", "none"))


def saved_quantization_problems(args, resume_iteration: Optional[int], initial) -> List[str]:
    """--base-quantization against the checkpoint the run continues ([]: the same, or unknown).

    resume_iteration: --save's checkpoint iteration (None: a fresh run); initial: the run's
    training.initial_adapter.InitialAdapter (None without --adapter). A resume is checked against
    --save's checkpoint, a fresh run from an adapter checkpoint of ours against that adapter; a
    PEFT folder records no quantisation and is not checked."""
    asked = getattr(args, "base_quantization", "none")
    if resume_iteration is not None:
        path = args.save
        whose = f"--save {args.save}'s checkpoint (iteration {resume_iteration}), which this run " \
                "resumes,"
    elif initial is not None and initial.directory is not None and initial.imported is None:
        path, whose = initial.directory, f"--adapter {initial.source}"
    else:
        return []
    saved = saved_base_quantization(path)
    if saved is None or saved == asked:
        return []
    return [f"--base-quantization {asked} differs from the base {whose} was trained on "
            f"(--base-quantization {saved}): its adapter was fitted to that base; give "
            f"--base-quantization {saved}"]
