"""Training samples from megatron-core indexed datasets, packed lazily per batch.

A prefix P (`P.bin` and `P.idx` exist) is opened with megatron-core's `IndexedDataset`; every
sequence is one sample. Its loss mask comes from `P_targets.bin/.idx` when
they exist (`megatron-lora preprocess`, data/preprocess.py), otherwise every token is a target (a
Megatron-LM `preprocess_data.py` prefix: causal LM). A prefix whose `P.json` says it was written
by `preprocess` must have its targets, and its tokenizer's vocabulary size and special ids must be
those of train's --tokenizer.

Packing is that of `data/packing.py` and `data/jsonl.py`'s `read_jsonl` for the same samples in
the same order: truncation to `max_tokens` (--seq-length+1), samples without a target after their
first token dropped, greedy in-order packing. Only the packing plan is computed at start-up, in
one chunked pass over the sequence lengths and loss masks (`PackPlan`: 4 bytes per sample and 8
per row, no token held); the rows of a batch are read from the files (by offset, not through the
memory maps: one rank's resident memory stays flat in the number of samples) when the batch is
asked for, and are exactly the rows `pack_samples` would have built (benchmarks/data.py measures
start-up memory at 10^4 and 10^6 samples). `IndexedPackedDataset` orders its rows as
`PackedDataset` does (same permutation for a seed and epoch), so a JSONL file and its
preprocessed prefix give the same batches at every consumed-samples position.
"""

from __future__ import annotations

import os
from array import array
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_lora.data.batches import Batch, PackedDataset
from megatron_lora.data.jsonl import DataError
from megatron_lora.data.indexed_check import MASK_CODES, check_index, read_meta
from megatron_lora.data.indexed_writer import INDEX_HEADER_BYTES as _IDX_HEADER
from megatron_lora.data.packing import inputs_labels_mask

TARGETS_SUFFIX = "_targets"
PREPROCESS_FORMAT = "megatron-lora indexed samples"
_CHUNK_TOKENS = 1 << 18  # loss-mask bytes scanned at a time when planning


def is_prefix(path: str) -> bool:
    """Whether `path` names an indexed dataset: `path.bin` and `path.idx` both exist (of any
    kind: IndexedSamples refuses those that are not regular files, naming them)."""
    return os.path.exists(path + ".bin") and os.path.exists(path + ".idx")


class IndexedSamples:
    """The samples of one prefix: `tokens(i, count)`, `targets(i, count)` (numpy, the first
    `count` values, all by default), `lengths` (int32 [N], a view of megatron-core's map of
    `P.idx`). The indexes are checked whole first (data/indexed_check.py), then opened with
    megatron-core's `IndexedDataset`; values are read by file offset (`_Sequences`), so the
    pages read are not held in this process."""

    def __init__(self, prefix: str, tokenizer=None, flag: str = "--data-path"):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        if not is_prefix(prefix):
            raise DataError(f"{flag} {prefix}: not an indexed dataset ({prefix}.bin and "
                            f"{prefix}.idx must both exist)")
        self.prefix = prefix
        meta = read_meta(prefix, flag, PREPROCESS_FORMAT)
        where = f"{flag} {prefix}"
        info = check_index(prefix, where)
        targets = prefix + TARGETS_SUFFIX
        if is_prefix(targets):
            masks = check_index(targets, where, MASK_CODES, "loss masks")
            if masks.sequences != info.sequences:
                raise DataError(f"{where}: {targets}.idx has {masks.sequences} sequences, "
                                f"{prefix}.idx {info.sequences}; run `megatron-lora "
                                f"preprocess` again")
        self.tokens_ds = IndexedDataset(prefix, mmap=True)
        self.lengths = self.tokens_ds.sequence_lengths  # int32 [N], a view of the .idx map
        self.itemsize = np.dtype(self.tokens_ds.index.dtype).itemsize
        self._files = {"tokens": _Sequences(prefix, len(self), self.itemsize)}
        self.targets_ds = None
        if is_prefix(targets):
            self.targets_ds = IndexedDataset(targets, mmap=True)
            self._files["targets"] = _Sequences(targets, len(self), 1)
            if not self._same_lengths(self._files["targets"]):
                raise DataError(f"{flag} {prefix}: {targets}.bin/.idx does not match "
                                f"{prefix}.bin/.idx (other sequence lengths); run "
                                f"`megatron-lora preprocess` again")
        elif meta is not None:
            raise DataError(f"{flag} {prefix}: {targets}.bin/.idx (the loss masks written by "
                            f"`megatron-lora preprocess`) are missing")
        if len(self):  # the layout _Sequences reads is the one megatron-core's reader maps
            last = len(self) - 1
            for name, ds in (("tokens", self.tokens_ds), ("targets", self.targets_ds)):
                if ds is not None and self._files[name].pointers(last, last + 1)[0] != \
                        ds.index.sequence_pointers[last]:
                    raise DataError(f"{flag} {prefix}: {self._files[name].path}.idx is not "
                                    f"laid out as megatron-core's indexed datasets are")
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
            smallest, largest = self.token_range()
            if smallest < 0:
                raise DataError(f"{flag} {prefix}: {prefix}.bin holds the negative token id "
                                f"{smallest}; write the dataset again")
            if largest >= tokenizer.vocab_size:
                raise DataError(f"{flag} {prefix}: {prefix}.bin holds token id {largest}, "
                                f"outside the --tokenizer's {tokenizer.vocab_size} ids; give "
                                f"the tokenizer the prefix was made with")

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    def _same_lengths(self, other: "_Sequences") -> bool:
        step = _CHUNK_TOKENS
        return all(np.array_equal(other.lengths(a, min(a + step, len(self))),
                                  self.lengths[a:a + step]) for a in range(0, len(self), step))

    def tokens(self, i: int, count: Optional[int] = None) -> np.ndarray:
        """Sample i's first `count` token ids (all of them by default), read from `P.bin`."""
        n = int(self.lengths[i]) if count is None else min(int(count), int(self.lengths[i]))
        return self._files["tokens"].read(int(i), n, self.tokens_ds.index.dtype)

    def targets(self, i: int, count: Optional[int] = None) -> np.ndarray:
        n = int(self.lengths[i]) if count is None else min(int(count), int(self.lengths[i]))
        if self.targets_ds is None:
            return np.ones(n, dtype=np.uint8)
        return self._files["targets"].read(int(i), n, np.uint8)

    def max_token(self) -> int:
        """The largest token id in `P.bin` (token_range)."""
        return self.token_range()[1]

    def token_range(self) -> Tuple[int, int]:
        """(smallest, largest) token id in `P.bin` ((0, -1) when empty), read in chunks of
        about _CHUNK_TOKENS ids (not through the memory map, whose pages would stay resident):
        the ids come from a file, and one outside the vocabulary (a negative one from a signed
        dtype included) would fail inside the embedding of some ranks only."""
        dtype = np.dtype(self.tokens_ds.index.dtype)
        step, smallest, largest = _CHUNK_TOKENS * dtype.itemsize, 0, -1
        with open(self.prefix + ".bin", "rb") as f:
            while True:
                data = f.read(step)
                if not data:
                    return smallest, largest
                ids = np.frombuffer(data[:len(data) - len(data) % dtype.itemsize], dtype=dtype)
                if ids.size:
                    smallest = min(smallest, int(ids.min()))
                    largest = max(largest, int(ids.max()))

    def first_targets(self) -> np.ndarray:
        """For each sample, the first position >= 1 whose token is a target (its length if
        none): a sample truncated to L tokens teaches something iff this is < L. int32 [N]."""
        parts = [first for _, _, first in self.first_target_chunks()]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

    def first_target_chunks(self):
        """first_targets() in consecutive pieces: (a, b, first [b-a] int32 of samples a..b-1),
        each of about _CHUNK_TOKENS loss-mask bytes of whole samples, read from the files (not
        through the memory maps, whose pages would stay resident): ~10 bytes of temporaries per
        chunk byte (2.5 MiB), whatever the number of samples."""
        n = len(self)
        if self.targets_ds is None:
            for a in range(0, n, 1 << 16):
                lengths = np.asarray(self.lengths[a:a + (1 << 16)], dtype=np.int32)
                yield a, a + lengths.shape[0], np.minimum(lengths, 1)
            return
        files = self._files["targets"]
        none = np.int32(np.iinfo(np.int32).max)
        a = 0
        while a < n:
            window = np.asarray(self.lengths[a:a + _CHUNK_TOKENS], dtype=np.int32)
            b = a + max(1, int(np.searchsorted(np.cumsum(window, dtype=np.int64),
                                               _CHUNK_TOKENS, side="right")))
            b = min(b, n)
            lengths = window[:b - a]
            pointers = files.pointers(a, b)  # int64 byte offsets (uint8 masks)
            lo, hi = int(pointers[0]), int(pointers[-1] + lengths[-1])
            data = files.read_bytes(lo, hi - lo)
            first = lengths.copy()
            full = np.flatnonzero(lengths > 0)
            if full.size:
                starts = (pointers[full] - lo).astype(np.int32)
                mark = data != 0
                mark[starts] = False  # a sample's first token is never a target
                pos = np.where(mark, np.arange(data.shape[0], dtype=np.int32), none)
                found = np.minimum.reduceat(pos, starts) if pos.size else pos
                first[full] = np.where(found < none, found - starts, lengths[full])
            yield a, b, first
            a = b


class _Sequences:
    """Reads of one `.bin`/`.idx` pair by file offset (os.pread), not through memory maps: the
    pages read stay in the page cache, not in this process's resident set. The `.idx` layout is
    megatron-core's (data/indexed_writer.py): 34 header bytes, lengths int32 [N], byte offsets
    int64 [N], ..."""

    def __init__(self, path: str, n: int, itemsize: int):
        self.path, self.n, self.itemsize = path, n, itemsize
        self.idx = os.open(path + ".idx", os.O_RDONLY)
        self.bin = os.open(path + ".bin", os.O_RDONLY)
        if os.fstat(self.idx).st_size < _IDX_HEADER + 12 * n:
            raise DataError(f"{path}.idx is shorter than its header says; write it again")

    def __del__(self):
        for fd in (getattr(self, "idx", None), getattr(self, "bin", None)):
            if fd is not None:
                os.close(fd)

    def _pread(self, fd: int, size: int, offset: int, what: str) -> bytes:
        data = os.pread(fd, size, offset)
        if len(data) != size:
            raise DataError(f"{self.path}{what} is shorter than its .idx says; run "
                            f"`megatron-lora preprocess` again")
        return data

    def lengths(self, a: int, b: int) -> np.ndarray:
        return np.frombuffer(self._pread(self.idx, 4 * (b - a), _IDX_HEADER + 4 * a, ".idx"),
                             dtype=np.int32)

    def pointers(self, a: int, b: int) -> np.ndarray:
        offset = _IDX_HEADER + 4 * self.n + 8 * a
        return np.frombuffer(self._pread(self.idx, 8 * (b - a), offset, ".idx"), dtype=np.int64)

    def read_bytes(self, offset: int, size: int) -> np.ndarray:
        return np.frombuffer(self._pread(self.bin, size, offset, ".bin"), dtype=np.uint8)

    def read(self, i: int, count: int, dtype) -> np.ndarray:
        """The first `count` values of sequence i."""
        start = int(self.pointers(i, i + 1)[0])
        return self.read_bytes(start, count * self.itemsize).view(dtype)


@dataclass
class PackPlan:
    """Which samples make which packed row, from the lengths and loss masks.

    kept: [K] int32 (int64 beyond 2^31 samples) sample indices of the prefix, in order (those
    with a target after truncation); row_starts: [R+1] int64, row r holds
    kept[row_starts[r]:row_starts[r+1]]; max_tokens: the truncation (a kept sample k holds
    min(lengths[k], max_tokens) tokens); truncated counts every sample longer than max_tokens
    (as read_jsonl counts them, dropped ones included)."""

    kept: np.ndarray
    row_starts: np.ndarray
    max_tokens: int
    truncated: int

    @property
    def num_rows(self) -> int:
        return int(self.row_starts.shape[0] - 1)


def plan_packing(samples: IndexedSamples, max_tokens: int) -> PackPlan:
    """pack_samples' greedy in-order packing of the usable truncated samples into rows of
    `max_tokens` tokens (data/packing.py), as a plan. One pass over the samples in chunks
    (first_target_chunks): besides `kept` (4 bytes a sample) and the row starts (8 bytes a
    row), memory does not grow with the number of samples."""
    n = len(samples)
    kept = np.empty(n, dtype=np.int64 if n >= 2**31 else np.int32)
    starts, k, used, truncated = array("q", [0]), 0, 0, 0
    for a, b, first in samples.first_target_chunks():
        full = np.asarray(samples.lengths[a:b])
        truncated += int(np.count_nonzero(full > max_tokens))
        trunc = np.minimum(full, max_tokens).astype(np.int32)
        keep = np.flatnonzero(first < trunc)
        kept[k:k + keep.shape[0]] = keep + a
        for j, length in enumerate(trunc[keep].tolist(), k):  # the greedy loop
            if used + length > max_tokens:
                starts.append(j)
                used = 0
            used += length
        k += keep.shape[0]
    if k:
        starts.append(k)
    return PackPlan(kept[:k], np.frombuffer(starts, dtype=np.int64), max_tokens, truncated)


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
                k = int(plan.kept[j])
                length = min(int(self.samples.lengths[k]), plan.max_tokens)
                tokens[out, at:at + length] = self.samples.tokens(k, length)
                targets[out, at:at + length] = self.samples.targets(k, length)
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
