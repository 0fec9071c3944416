"""`train --data-path` / `--valid-data-path` values -> packed datasets.

A value is one path, or Megatron-LM's weighted blend `W1 PATH1 W2 PATH2 ...` (data/blend.py).
Each path is an indexed prefix when `PATH.bin` and `PATH.idx` exist (data/indexed.py: memory-mapped,
packed per batch), otherwise a JSONL file (data/jsonl.py: read, tokenized and packed at start-up).
Both pack the same samples into the same rows in the same order for a seed. `eval_fraction`
holds out the last rows of each path (for a blend, the held-out parts are blended with the same
weights).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_lora.data.jsonl import DataError


@dataclass
class Source:
    train: object  # PackedDataset interface
    held_out: Optional[object]
    samples: int
    truncated: int


def _open_one(path: str, tokenizer, seq_length: int, seed: int, eval_fraction: float,
              flag: str) -> Source:
    from megatron_lora.data.batches import PackedDataset
    from megatron_lora.data.indexed import is_prefix, open_indexed
    from megatron_lora.data.jsonl import read_jsonl
    from megatron_lora.data.packing import PackedRows, pack_samples

    if is_prefix(path):
        train, held, stats = open_indexed(path, tokenizer, seq_length, seed, eval_fraction, flag)
        return Source(train, held, stats["samples"], stats["truncated"])
    if not os.path.exists(path):
        raise DataError(f"{flag} {path}: neither a JSONL file nor an indexed dataset prefix "
                        f"({path}.bin and {path}.idx, from `megatron-lora preprocess`)")
    samples, truncated = read_jsonl(path, tokenizer, max_tokens=seq_length + 1)
    rows = pack_samples(samples, seq_length, tokenizer.pad_id)
    n = rows.tokens.shape[0]
    n_eval = int(round(n * eval_fraction))

    def take(lo, hi):
        return PackedRows(rows.tokens[lo:hi], rows.targets[lo:hi], rows.sample_ids[lo:hi],
                          rows.num_samples)

    train = PackedDataset(take(0, n - n_eval), seed=seed)
    held = PackedDataset(take(n - n_eval, n), seed=seed) if n_eval else None
    return Source(train, held, len(samples), truncated)


def open_data(values: Sequence[str], tokenizer, seq_length: int, seed: int,
              eval_fraction: float = 0.0, flag: str = "--data-path") -> Source:
    """The packed training (and held-out) data of a --data-path value (module docstring).
    Raises DataError / ValueError naming `flag`."""
    from megatron_lora.data.blend import BlendedDataset, parse_blend

    if isinstance(values, str):
        values = [values]
    blend = parse_blend(values, flag)
    parts = [_open_one(path, tokenizer, seq_length, seed, eval_fraction, flag)
             for _, path in blend]
    if len(parts) == 1:
        return parts[0]
    weights = [w for w, _ in blend]
    held = None
    if any(p.held_out is not None for p in parts):
        missing = [path for (_, path), p in zip(blend, parts) if p.held_out is None]
        if missing:
            raise DataError(f"--eval-fraction {eval_fraction} holds out no sequence of "
                            f"{', '.join(missing)}; raise it or give --valid-data-path")
        held = BlendedDataset([p.held_out for p in parts], weights)
    return Source(BlendedDataset([p.train for p in parts], weights), held,
                  sum(p.samples for p in parts), sum(p.truncated for p in parts))


__all__ = ["Source", "open_data"]
