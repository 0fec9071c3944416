"""Which modules a LoraConfig targets: megatron names, their Hugging Face equivalents, all-linear.

Megatron fuses some HF projections: q/k/v are one `linear_qkv`, and w1/w3 (gate/up) are one
`linear_fc1`. Targeting any part of a fused projection targets the whole fused module (one adapter
covering all its parts; on export it splits losslessly into per-part adapters).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

# Target kinds, in the order a model lists them.
KINDS: Tuple[str, ...] = (
    "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "router", "embedding", "output_layer",
)
ALL_LINEAR: Tuple[str, ...] = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")

HF_TO_MCORE: Dict[str, str] = {
    "q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "qkv_proj": "linear_qkv",
    "o_proj": "linear_proj",
    "w1": "linear_fc1", "w3": "linear_fc1", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
    "w2": "linear_fc2", "down_proj": "linear_fc2",
    "gate": "router",
    "embed_tokens": "embedding",
    "lm_head": "output_layer",
}


class UnknownTargetError(ValueError):
    """A target_modules entry that names nothing in the model."""


def normalize_targets(targets) -> Tuple[str, ...]:
    """target_modules (str or list; megatron names, HF names, "all-linear") -> megatron kinds.

    Raises UnknownTargetError for a name that is neither, listing the accepted names.
    """
    if isinstance(targets, str):
        targets = [targets]
    out: List[str] = []
    for name in targets:
        if name in ("all-linear", "all_linear"):
            kinds: Iterable[str] = ALL_LINEAR
        elif name in KINDS:
            kinds = (name,)
        elif name in HF_TO_MCORE:
            kinds = (HF_TO_MCORE[name],)
        else:
            raise UnknownTargetError(
                f"unknown LoRA target {name!r}; accepted: {', '.join(KINDS)}, their Hugging Face "
                f"names ({', '.join(sorted(HF_TO_MCORE))}) and 'all-linear'"
            )
        out.extend(k for k in kinds if k not in out)
    if not out:
        raise UnknownTargetError("target_modules is empty")
    return tuple(k for k in KINDS if k in out)
