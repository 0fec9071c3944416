"""Cheap checks of an HF folder against its config.json before the expected-tensor table is
built or anything is copied.

`check_counts` compares config.json's layer and expert counts with what the checkpoint's tensor
names hold, from the names alone: the table of expected tensors (convert/mapping.py `hf_shapes`)
grows with layers x experts, so a config claiming a million layers of a 2-layer checkpoint must
be refused before it is built (it took ~11 GB and minutes, then MemoryError).
`check_json_files` parses the JSON files hf-to-mcore copies (tokenizer.json, ...), so a file that
is not JSON is refused by name instead of being copied into the output.
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterable

from megatron_lora.convert.errors import ConversionError


def _indices(names: Iterable[str], pattern: str) -> set:
    """The integers `{n}` takes in the names matching `pattern` (a name template with `{n}`)."""
    head, tail = pattern.split("{n}")
    rx = re.compile(re.escape(head) + r"(\d+)" + re.escape(tail))
    return {int(m.group(1)) for m in map(rx.match, names) if m}


def check_counts(hf_dir: str, info, names: Iterable[str]) -> None:
    """ConversionError naming config.json's field when it counts more decoder layers (or, for a
    family with one module per expert, more experts) than the checkpoint's tensor names hold."""
    names = list(names)
    config = os.path.join(hf_dir, "config.json")
    fam, s = info.family, info.shape
    layers = _indices(names, fam.names.layer.replace("{l}", "{n}"))
    held = f"layers 0..{max(layers)} ({len(layers)} layers)" if layers else "no decoder layer"
    if s.num_layers > len(layers) or s.num_layers - 1 > max(layers, default=-1):
        raise ConversionError(
            f"{config}: num_hidden_layers={s.num_layers}, but the checkpoint's tensors in "
            f"{hf_dir} hold {held} (names {fam.names.layer.format(l='N')}...); pass this "
            f"checkpoint's own config.json")
    if fam.fused_experts or not s.num_experts:
        return
    layer0 = fam.names.layer.format(l=min(l for l in range(s.num_layers) if s.is_moe_layer(l)))
    experts = _indices(names, layer0 + fam.names.expert.replace("{e}", "{n}"))
    if s.num_experts - 1 > max(experts, default=-1):
        have = f"experts 0..{max(experts)}" if experts else "no expert"
        raise ConversionError(
            f"{config}: {fam.experts_field}={s.num_experts}, but the checkpoint's tensors in "
            f"{hf_dir} hold {have} in layer {layer0}; pass this checkpoint's own config.json")


def check_json_files(hf_dir: str, names: Iterable[str]) -> None:
    """ConversionError naming the first file of `names` (relative to hf_dir, `.json` ones) that
    exists and is not JSON."""
    for name in names:
        path = os.path.join(hf_dir, name)
        if not name.endswith(".json") or not os.path.isfile(path):
            continue
        try:
            with open(path, "rb") as f:
                json.loads(f.read())
        except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
            raise ConversionError(f"{path}: not a JSON file ({str(exc)[:200]}); fix or remove "
                                  f"it (conversion copies it beside the checkpoint)") from None
