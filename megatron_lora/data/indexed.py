"""Training samples from megatron-core indexed datasets, packed lazily per batch.

A prefix P (`P.bin` and `P.idx` exist) is read memory-mapped with megatron-core's
`IndexedDataset`; every sequence is one sample. Its loss mask comes from `P_targets.bin/.idx` when
they exist (`megatron-lora preprocess`, data/preprocess.py), otherwise every token is a target (a
Megatron-LM `preprocess_data.py` prefix: causal LM). A prefix whose `P.json` says it was written
by `preprocess` must have its targets, and its tokenizer's vocabulary size and special ids must be
those of train's --tokenizer.

Packing is that of `data/packing.py` and `data/jsonl.py`'s `read_jsonl` for the same samples in
the same order: truncation to `max_tokens` (--seq-length+1), samples without a target after their
first token dropped, greedy in-order packing. Only the packing plan is computed at start-up, from
the sequence lengths and loss masks (`PackPlan`: 8 bytes per sample, no token held); the rows of
a batch are built from the memory map when the batch is asked for, and are exactly the rows
`pack_samples` would have built. `IndexedPackedDataset` orders its rows as `PackedDataset` does
(same permutation for a seed and epoch), so a JSONL file and its preprocessed prefix give the same
batches at every consumed-samples position.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from megatron_lora.data.batches import Batch, PackedDataset
from megatron_lora.data.jsonl import DataError
from megatron_lora.data.packing import inputs_labels_mask

TARGETS_SUFFIX = "_targets"
PREPROCESS_FORMAT = "megatron-lora indexed samples"
_CHUNK_TOKENS = 1 << 18  # loss-mask bytes scanned at a time when planning


def is_prefix(path: str) -> bool:
    """Whether `path` names an indexed dataset: `path.bin` and `path.idx` both exist."""
    return os.path.isfile(path + ".bin") and os.path.isfile(path + ".idx")


class IndexedSamples:
    """The samples of one prefix: `tokens(i)`, `targets(i)` (numpy, untruncated), `lengths`.

    Memory-mapped; the arrays returned are views of the map (copied by the packer)."""

    def __init__(self, prefix: str, tokenizer=None, flag: str = "--data-path"):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        if not is_prefix(prefix):
            raise DataError(f"{flag} {prefix}: not an indexed dataset ({prefix}.bin and "
                            f"{prefix}.idx must both exist)")
        self.prefix = prefix
        meta = _read_meta(prefix, flag)
        self.tokens_ds = IndexedDataset(prefix, mmap=True)
        self.lengths = self.tokens_ds.sequence_lengths  # int32 [N], a view of the .idx map
        targets = prefix + TARGETS_SUFFIX
        self.targets_ds = None
        if is_prefix(targets):
            self.targets_ds = IndexedDataset(targets, mmap=True)
            if not np.array_equal(self.targets_ds.sequence_lengths, self.lengths):
                raise DataError(f"{flag} {prefix}: {targets}.bin/.idx does not match "
                                f"{prefix}.bin/.idx (other sequence lengths); run "
                                f"`megatron-lora preprocess` again")
        elif meta is not None:
            raise DataError(f"{flag} {prefix}: {targets}.bin/.idx (the loss masks written by "
                            f"`megatron-lora preprocess`) are missing")
        if meta is not None and tokenizer is not None:
            ours = {"vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id,
                    "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id}
            differ = [f"{k} {meta.get(k)} there, {v} here" for k, v in ours.items()
                      if meta.get(k) != v]
            if differ:
                raise DataError(f"{flag} {prefix}: written with the tokenizer "
                                f"{meta.get('tokenizer')!r}, not the --tokenizer of this run "
                                f"({'; '.join(differ)})")
        if tokenizer is not None:
            largest = self.max_token()
            if largest >= tokenizer.vocab_size:
                raise DataError(f"{flag} {prefix}: {prefix}.bin holds token id {largest}, "
                                f"outside the --tokenizer's {tokenizer.vocab_size} ids; give "
                                f"the tokenizer the prefix was made with")

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def tokens(self, i: int) -> np.ndarray:
        return self.tokens_ds[int(i)]

    def targets(self, i: int) -> np.ndarray:
        if self.targets_ds is None:
            return np.ones(int(self.lengths[i]), dtype=np.uint8)
        return self.targets_ds[int(i)]

    def max_token(self) -> int:
        """The largest token id in `P.bin`, read in chunks of about _CHUNK_TOKENS ids (not
        through the memory map, whose pages would stay resident): the ids come from a file, and
        one outside the vocabulary would fail inside the embedding of some ranks only."""
        dtype = np.dtype(self.tokens_ds.index.dtype)
        step, largest = _CHUNK_TOKENS * dtype.itemsize, -1
        with open(self.prefix + ".bin", "rb") as f:
            while True:
                data = f.read(step)
                if not data:
                    return largest
                largest = max(largest, int(np.frombuffer(
                    data[:len(data) - len(data) % dtype.itemsize], dtype=dtype).max(initial=0)))

    def first_targets(self) -> np.ndarray:
        """For each sample, the first position >= 1 whose token is a target (its length if
        none): a sample truncated to L tokens teaches something iff this is < L."""
        n = len(self)
        if self.targets_ds is None:
            return np.minimum(np.ones(n, dtype=np.int32), self.lengths)
        first = np.array(self.lengths, dtype=np.int32)
        pointers = self.targets_ds.index.sequence_pointers  # int64 byte offsets (uint8 masks)
        none = np.int32(np.iinfo(np.int32).max)
        # Read in chunks of about _CHUNK_TOKENS bytes of whole samples (not through the memory
        # map, whose pages would stay resident): ~10 bytes of temporaries per chunk byte (2.5 MiB).
        with open(self.prefix + TARGETS_SUFFIX + ".bin", "rb") as f:
            a = 0
            while a < n:
                b = int(np.searchsorted(pointers, pointers[a] + _CHUNK_TOKENS, side="right"))
                b = min(max(b, a + 1), n)
                lo, hi = int(pointers[a]), int(pointers[b - 1] + self.lengths[b - 1])
                f.seek(lo)
                data = np.frombuffer(f.read(hi - lo), dtype=np.uint8)
                if data.shape[0] != hi - lo:
                    raise DataError(f"{self.prefix}{TARGETS_SUFFIX}.bin is shorter than its "
                                    f".idx says; run `megatron-lora preprocess` again")
                lengths = np.asarray(self.lengths[a:b])
                full = np.flatnonzero(lengths > 0)
                if full.size:
                    starts = (pointers[a:b][full] - lo).astype(np.int32)
                    mark = data != 0
                    mark[starts] = False  # a sample's first token is never a target
                    pos = np.where(mark, np.arange(data.shape[0], dtype=np.int32), none)
                    found = np.minimum.reduceat(pos, starts) if pos.size else pos
                    first[a + full] = np.where(found < none, found - starts, lengths[full])
                a = b
        return first


def _read_meta(prefix: str, flag: str) -> Optional[dict]:
    path = prefix + ".json"
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as exc:
        raise DataError(f"{flag} {prefix}: cannot read {path} ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != PREPROCESS_FORMAT:
        return None  # someone else's P.json: a plain Megatron-LM prefix
    return meta


@dataclass
class PackPlan:
    """Which samples make which packed row, from lengths alone.

    kept: [K] int32 (int64 beyond 2^31 samples) sample indices of the prefix, in order (those
    with a target after truncation); row_starts: [R+1] int64, row r holds
    kept[row_starts[r]:row_starts[r+1]]; lengths: [K] int32 truncated length of each kept sample. truncated counts every sample longer
    than max_tokens (as read_jsonl counts them, dropped ones included)."""

    kept: np.ndarray
    row_starts: np.ndarray
    lengths: np.ndarray
    truncated: int

    @property
    def num_rows(self) -> int:
        return int(self.row_starts.shape[0] - 1)


def plan_packing(samples: IndexedSamples, max_tokens: int) -> PackPlan:
    """pack_samples' greedy in-order packing of the usable truncated samples into rows of
    `max_tokens` tokens (data/packing.py), as a plan."""
    full = samples.lengths
    trunc = np.minimum(full, max_tokens).astype(np.int32)
    index = np.int64 if len(samples) >= 2**31 else np.int32
    kept = np.flatnonzero(samples.first_targets() < trunc).astype(index)
    lengths = trunc[kept]
    del trunc
    starts, used, step = [0], 0, 1 << 16
    for at in range(0, len(kept), step):  # the greedy loop, a slice of Python ints at a time
        for j, n in enumerate(lengths[at:at + step].tolist(), at):
            if used + n > max_tokens:
                starts.append(j)
                used = 0
            used += n
    if len(kept):
        starts.append(len(kept))
    return PackPlan(kept, np.asarray(starts, dtype=np.int64), lengths,
                    int(np.count_nonzero(full > max_tokens)))


class IndexedPackedDataset(PackedDataset):
    """PackedDataset's interface (`len`, `batch(consumed_samples, global_batch_size)`, the same
    row order for a seed) over rows [row_lo, row_hi) of a prefix's packing plan, built from the
    memory map per batch. Batch tensors as PackedDataset's: tokens/labels [B, S] int64,
    loss_mask [B, S] float32, attention_mask [B, 1, S, S] bool; the same on every rank."""

    def __init__(self, samples: IndexedSamples, plan: PackPlan, seq_length: int, pad_id: int,
                 seed: int, row_lo: int = 0, row_hi: Optional[int] = None):
        row_hi = plan.num_rows if row_hi is None else row_hi
        if row_hi <= row_lo:
            raise ValueError("no packed rows")
        self.samples, self.plan = samples, plan
        self.width, self.pad_id = seq_length + 1, pad_id
        self.row_lo, self.row_hi = row_lo, row_hi
        self.seed = seed
        self._cached_epoch, self._cached_order = -1, None

    def __len__(self) -> int:
        return self.row_hi - self.row_lo

    def rows(self, rows: Sequence[int]):
        """(tokens [N, S+1] int64, targets [N, S+1] float32, sample_ids [N, S+1] int64) of the
        given rows of this dataset, exactly as pack_samples lays them out."""
        n = len(rows)
        tokens = np.full((n, self.width), self.pad_id, dtype=np.int64)
        targets = np.zeros((n, self.width), dtype=np.float32)
        sample_ids = np.full((n, self.width), -1, dtype=np.int64)
        plan = self.plan
        for out, row in enumerate(rows):
            r = self.row_lo + int(row)
            at = 0
            for j in range(int(plan.row_starts[r]), int(plan.row_starts[r + 1])):
                k, length = int(plan.kept[j]), int(plan.lengths[j])
                tokens[out, at:at + length] = self.samples.tokens(k)[:length]
                targets[out, at:at + length] = self.samples.targets(k)[:length]
                sample_ids[out, at:at + length] = j
                at += length
        return torch.from_numpy(tokens), torch.from_numpy(targets), torch.from_numpy(sample_ids)

    def stream_rows(self, positions: Sequence[int]):
        """rows() of the given positions of the endless shuffled stream (epoch by epoch)."""
        idx = []
        for pos in positions:
            epoch, within = divmod(int(pos), len(self))
            idx.append(int(self._order(epoch)[within]))
        return self.rows(idx)

    def batch(self, consumed_samples: int, global_batch_size: int) -> Batch:
        """The global batch starting at position `consumed_samples` of the endless epoch stream."""
        return Batch(*inputs_labels_mask(*self.stream_rows(
            range(consumed_samples, consumed_samples + global_batch_size))))


def open_indexed(prefix: str, tokenizer, seq_length: int, seed: int, split_rows=None,
                 flag: str = "--data-path"):
    """(train IndexedPackedDataset, held-out one or None, stats) of one prefix.

    split_rows(n) -> ((train_lo, train_hi), (held_lo, held_hi)), ranges of the n packed rows
    (data/sources.py's; default: every row trains). stats: samples, truncated, rows."""
    samples = IndexedSamples(prefix, tokenizer, flag)
    plan = plan_packing(samples, seq_length + 1)
    if plan.num_rows == 0:
        raise DataError(f"{flag} {prefix}: no usable samples")
    n = plan.num_rows
    (t_lo, t_hi), (h_lo, h_hi) = split_rows(n) if split_rows is not None else ((0, n), (n, n))
    make = lambda lo, hi: IndexedPackedDataset(samples, plan, seq_length,  # noqa: E731
                                               tokenizer.pad_id, seed, lo, hi)
    train = make(t_lo, t_hi)
    held = make(h_lo, h_hi) if h_hi > h_lo else None
    return train, held, dict(samples=int(plan.kept.shape[0]), truncated=plan.truncated, rows=n)


__all__ = ["IndexedPackedDataset", "IndexedSamples", "PackPlan", "is_prefix", "open_indexed",
           "plan_packing"]
