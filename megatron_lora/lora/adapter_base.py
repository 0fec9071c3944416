"""The base model an adapter was trained on, recorded with it and checked where it is applied.

An adapter's tensor shapes fix only some sizes: an attention-only adapter trained on a Mixtral
has the shapes of one for an OLMoE of the same width and loaded onto it silently. So `train`
(and PEFT import) store `base_record(info)` in the checkpoint's run metadata (`run_metadata.base`:
the family, config.json's model_type and the model's sizes), and every command that applies an
adapter (`train --adapter`, `logits` / `generate --adapter`, `export peft` / `hf`) calls
`check_base`: a different family or different sizes are refused, naming both, unless the user
says the base is intended (`--allow-other-base`). Adapters written before the record load with
a notice (their shapes are still checked).
"""

from __future__ import annotations

import sys
from typing import Optional

ALLOW_FLAG = "--allow-other-base"
_SIZES = ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
          "head_dim", "num_experts", "ffn_hidden_size", "dense_ffn_hidden_size")


class AdapterBaseError(ValueError):
    """An adapter applied to a base model other than the one it was trained on."""


def base_record(info) -> dict:
    """{family, model_type, sizes} of the model `info` (families.ModelInfo): plain data."""
    s = info.shape
    sizes = dict(vocab_size=info.vocab_size, hidden_size=s.hidden_size, num_layers=s.num_layers,
                 num_attention_heads=s.num_attention_heads, num_query_groups=s.num_query_groups,
                 head_dim=info.head_dim, num_experts=s.num_experts,
                 ffn_hidden_size=s.ffn_hidden_size, dense_ffn_hidden_size=s.dense_ffn_hidden_size)
    return {"family": info.family.name, "model_type": info.hf_config.get("model_type"), **sizes}


def _describe(record: dict) -> str:
    sizes = ", ".join(f"{k}={record.get(k)}" for k in _SIZES if record.get(k) is not None)
    return f"{record.get('family')} ({sizes})"


def check_base(run_metadata: Optional[dict], info, source: str,
               allow_other_base: bool = False) -> Optional[str]:
    """Raise AdapterBaseError when the adapter whose run metadata is `run_metadata` (its
    checkpoint `source`, for messages) records a base other than `info`'s; returns a notice
    (None when the bases agree): for an adapter without the record, or one allowed onto another
    base."""
    saved = (run_metadata or {}).get("base")
    if not isinstance(saved, dict):
        return (f"{source} does not record the base model it was trained on (written before "
                f"adapters recorded it): only its tensor shapes were checked against this model")
    here = base_record(info)
    differ = [k for k in ("family",) + _SIZES if saved.get(k) != here.get(k)]
    if not differ:
        return None
    what = (f"{source} was trained on a {_describe(saved)} base, not this {_describe(here)} one "
            f"(differing: {', '.join(differ)})")
    if allow_other_base:
        return f"{what}; applied anyway ({ALLOW_FLAG})"
    raise AdapterBaseError(f"{what}; give the base it was trained on, or pass {ALLOW_FLAG} if "
                           f"this base is intended")


def say_once(note: Optional[str]) -> None:
    """Print `note` (if any) as a notice on stderr, on the first rank only."""
    if not note:
        return
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"notice: {note}", file=sys.stderr)
