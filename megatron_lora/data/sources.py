"""`train --data-path` / `--valid-data-path` values -> packed datasets.

A value is one path, or Megatron-LM's weighted blend `W1 PATH1 W2 PATH2 ...` (data/blend.py).
Each path is an indexed prefix when `PATH.bin` and `PATH.idx` exist (data/indexed.py: memory-mapped,
packed per batch), otherwise a JSONL file (data/jsonl.py: read, tokenized and packed at start-up).
Both pack the same samples into the same rows in the same order for a seed. `eval_fraction`
holds out the last rows of each path, Megatron-LM's `--split A,B,C` the rows after the first
A/(A+B+C) of each (`split_rows`); for a blend the held-out parts are blended with the same weights.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from megatron_lora.data.jsonl import DataError


@dataclass
class Source:
    train: object  # PackedDataset interface
    held_out: Optional[object]
    samples: int
    truncated: int


def parse_split(text: str) -> Tuple[float, float, float]:
    """Megatron-LM's `--split A,B,C` (train, validation, test weights; "98,2" means "98,2,0") as
    fractions summing to 1. Raises ValueError naming --split."""
    parts = [p.strip() for p in text.split(",")]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(not math.isfinite(w) or w < 0 for w in weights) \
            or sum(weights) <= 0 or weights[0] <= 0:
        raise ValueError(f"--split {text!r}: expected up to three non-negative weights "
                         f"TRAIN,VALID,TEST with TRAIN > 0, e.g. 98,2,0")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return tuple(w / total for w in weights)  # type: ignore[return-value]


def split_rows(n: int, eval_fraction: float = 0.0, split=None):
    """((train_lo, train_hi), (held_lo, held_hi)) of n packed rows: with `split` (fractions
    from parse_split) the first round(n*A) rows train and the next round(n*(A+B)) - round(n*A)
    validate (the test part is not used), as Megatron-LM splits each dataset; otherwise the last
    round(n * eval_fraction) rows are held out."""
    if split is not None:
        t = int(round(n * split[0]))
        v = int(round(n * (split[0] + split[1])))
        return (0, t), (t, v)
    n_eval = int(round(n * eval_fraction))
    return (0, n - n_eval), (n - n_eval, n)


def _open_one(path: str, tokenizer, seq_length: int, seed: int, rows_of, flag: str) -> Source:
    from megatron_lora.data.batches import PackedDataset
    from megatron_lora.data.indexed import is_prefix, open_indexed
    from megatron_lora.data.jsonl import read_jsonl
    from megatron_lora.data.packing import PackedRows, pack_samples

    if is_prefix(path):
        train, held, stats = open_indexed(path, tokenizer, seq_length, seed, rows_of, flag)
        return Source(train, held, stats["samples"], stats["truncated"])
    if not os.path.exists(path):
        raise DataError(f"{flag} {path}: neither a JSONL file nor an indexed dataset prefix "
                        f"({path}.bin and {path}.idx, from `megatron-lora preprocess`)")
    samples, truncated = read_jsonl(path, tokenizer, max_tokens=seq_length + 1)
    rows = pack_samples(samples, seq_length, tokenizer.pad_id)
    (t_lo, t_hi), (h_lo, h_hi) = rows_of(rows.tokens.shape[0])

    def take(lo, hi):
        return PackedRows(rows.tokens[lo:hi], rows.targets[lo:hi], rows.sample_ids[lo:hi],
                          rows.num_samples)

    train = PackedDataset(take(t_lo, t_hi), seed=seed)
    held = PackedDataset(take(h_lo, h_hi), seed=seed) if h_hi > h_lo else None
    return Source(train, held, len(samples), truncated)


def open_data(values: Sequence[str], tokenizer, seq_length: int, seed: int,
              eval_fraction: float = 0.0, flag: str = "--data-path", split=None) -> Source:
    """The packed training (and held-out) data of a --data-path value (module docstring);
    `split`: parse_split's fractions (instead of eval_fraction). Raises DataError / ValueError
    naming `flag`."""
    from megatron_lora.data.blend import BlendedDataset, parse_blend

    if isinstance(values, str):
        values = [values]
    blend = parse_blend(values, flag)
    rows_of = lambda n: split_rows(n, eval_fraction, split)  # noqa: E731
    parts = [_open_one(path, tokenizer, seq_length, seed, rows_of, flag) for _, path in blend]
    if len(parts) == 1:
        return parts[0]
    weights = [w for w, _ in blend]
    held = None
    if any(p.held_out is not None for p in parts):
        missing = [path for (_, path), p in zip(blend, parts) if p.held_out is None]
        if missing:
            what = "--split" if split is not None else f"--eval-fraction {eval_fraction}"
            raise DataError(f"{what} holds out no sequence of {', '.join(missing)}; raise its "
                            f"validation share or give --valid-data-path")
        held = BlendedDataset([p.held_out for p in parts], weights)
    return Source(BlendedDataset([p.train for p in parts], weights), held,
                  sum(p.samples for p in parts), sum(p.truncated for p in parts))


__all__ = ["Source", "open_data", "parse_split", "split_rows"]
