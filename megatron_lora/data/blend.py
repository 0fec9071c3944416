"""Weighted blends of packed datasets (Megatron-LM's `--data-path 0.7 prefixA 0.3 prefixB`).

Position p of the blended stream (consumed samples, counted in packed sequences) is drawn from
dataset d by a deterministic low-discrepancy schedule that needs no seed: dataset d "arrives" at
times (k + 0.5) / w_d for k = 0, 1, ... (weights normalised to sum 1), and the stream is the
merge of all arrivals in time order (ties to the lower dataset index). The k-th draw of d is
position k of d's own endless shuffled stream (its seed-derived order, epoch by epoch), so a
blend is a pure function of the position: the same on every rank, at every layout, and a resume
from consumed_samples continues it exactly. After n positions dataset d has been drawn
w_d * n times to within the number of datasets (tests/data/test_blend.py measures it).
"""

from __future__ import annotations

import math
from typing import List, Sequence, Tuple

import numpy as np
import torch

from megatron_lora.data.batches import Batch, PackedDataset
from megatron_lora.data.packing import inputs_labels_mask


def parse_blend(values: Sequence[str], flag: str = "--data-path") -> List[Tuple[float, str]]:
    """[(weight, path)] of `PATH` or `W1 PATH1 W2 PATH2 ...` (weights positive, normalised to
    sum 1). Raises ValueError naming `flag`."""
    values = list(values)
    if len(values) == 1:
        return [(1.0, values[0])]
    if len(values) % 2:
        raise ValueError(f"{flag}: expected one path, or weight-path pairs like '0.7 prefixA "
                         f"0.3 prefixB' (got {len(values)} values)")
    pairs = []
    for w, path in zip(values[0::2], values[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise ValueError(f"{flag}: {w!r} is not a weight (a blend is given as weight-path "
                             f"pairs like '0.7 prefixA 0.3 prefixB')") from None
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"{flag}: the weight of {path} must be a positive number, got {w}")
        pairs.append((weight, path))
    total = sum(w for w, _ in pairs)
    return [(w / total, path) for w, path in pairs]


def blend_schedule(weights: Sequence[float], n: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset [n] int64, draw [n] int64): which dataset position p comes from and which draw of
    that dataset it is (module docstring). A prefix of the schedule for n is the schedule for
    any smaller n."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    times, owners = [], []
    for d, wd in enumerate(w):
        # Enough arrivals to cover the n-th merged time (<= n + len(w) / 2).
        k = np.arange(int(math.ceil(wd * (n + len(w)))) + 2, dtype=np.float64)
        times.append((k + 0.5) / wd)
        owners.append(np.full(k.shape, d, dtype=np.int64))
    t, o = np.concatenate(times), np.concatenate(owners)
    order = np.lexsort((o, t))[:n]
    dataset = o[order]
    draw = np.empty(n, dtype=np.int64)
    for d in range(len(w)):
        mine = dataset == d
        draw[mine] = np.arange(int(mine.sum()), dtype=np.int64)
    return dataset, draw


def stream_rows(dataset, positions: Sequence[int]):
    """(tokens, targets, sample_ids) [N, S+1] of `positions` of a dataset's endless stream: its
    own stream_rows(), or PackedDataset's rows in its seed order."""
    if hasattr(dataset, "stream_rows"):
        return dataset.stream_rows(positions)
    idx = []
    for pos in positions:
        epoch, within = divmod(int(pos), len(dataset))
        idx.append(int(dataset._order(epoch)[within]))
    index = torch.tensor(idx, dtype=torch.long, device="cpu")
    r = dataset.rows
    return r.tokens[index], r.targets[index], r.sample_ids[index]


class BlendedDataset(PackedDataset):
    """PackedDataset's interface over a weighted blend of packed datasets (PackedDataset or
    IndexedPackedDataset). len() is the sum of the parts' rows (an epoch of the blend)."""

    def __init__(self, parts: Sequence, weights: Sequence[float]):
        if not parts or len(parts) != len(weights):
            raise ValueError("a blend needs one weight per dataset")
        self.parts, self.weights = list(parts), [float(w) for w in weights]
        self._dataset = self._draw = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def _schedule(self, end: int):
        if end > self._dataset.shape[0]:
            self._dataset, self._draw = blend_schedule(
                self.weights, max(end, 2 * self._dataset.shape[0], 1024))
        return self._dataset, self._draw

    def stream_rows(self, positions: Sequence[int]):
        positions = [int(p) for p in positions]
        dataset, draw = self._schedule(max(positions) + 1)
        owner = dataset[positions]
        out = [None] * len(positions)
        for d, part in enumerate(self.parts):
            mine = [i for i, o in enumerate(owner) if o == d]
            if not mine:
                continue
            got = stream_rows(part, [int(draw[positions[i]]) for i in mine])
            for slot, i in enumerate(mine):
                out[i] = tuple(t[slot] for t in got)
        return tuple(torch.stack([o[k] for o in out]) for k in range(3))

    def batch(self, consumed_samples: int, global_batch_size: int) -> Batch:
        return Batch(*inputs_labels_mask(*self.stream_rows(
            range(consumed_samples, consumed_samples + global_batch_size))))


__all__ = ["BlendedDataset", "blend_schedule", "parse_blend", "stream_rows"]
