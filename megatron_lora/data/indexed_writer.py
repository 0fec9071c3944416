"""A streaming writer of megatron-core's indexed dataset files (`P.bin` / `P.idx`), without
importing megatron-core (its import costs seconds of start-up in `megatron-lora preprocess`).

The files are those `megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder` writes when
every document is one sequence (tests/data/test_indexed_writer.py checks them byte for byte
against the builder's, and reads them back with megatron-core's `IndexedDataset`):

- `P.bin`: the sequences' values, back to back, in the dataset's dtype.
- `P.idx`: the header `MMIDIDX\\x00\\x00`, `<Q` version 1, `<B` dtype code (megatron-core's
  `DType`: uint8 1, int8 2, int16 3, int32 4, int64 5, float64 6, float32 7, uint16 8), `<Q`
  sequence count N, `<Q` document count N+1, then sequence lengths int32 [N], sequence byte
  offsets into `P.bin` int64 [N], document boundaries int64 [N+1] (0, 1, ..., N).

Memory: the lengths are kept as an int32 array (4 bytes a sequence); the offsets and document
boundaries are computed and written in blocks at `finalize`.
"""

from __future__ import annotations

import struct
from array import array

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
# Bytes before the lengths of an .idx: magic, version <Q, dtype code <B, sequences <Q, documents <Q.
INDEX_HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8
DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3,
               np.dtype(np.int32): 4, np.dtype(np.int64): 5, np.dtype(np.float64): 6,
               np.dtype(np.float32): 7, np.dtype(np.uint16): 8}
_BLOCK = 1 << 20  # sequences per block of offsets written at finalize


def token_dtype(vocab_size: int) -> np.dtype:
    """megatron-core's `DType.optimal_dtype`: uint16 under 65500 ids, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


class IndexedWriter:
    """Append sequences to `bin_path` (opened now), then `finalize(idx_path)` writes the index."""

    def __init__(self, bin_path: str, dtype):
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"indexed datasets cannot hold {self.dtype}")
        self.data_file = open(bin_path, "wb")
        self.lengths = array("i")

    def add(self, values: np.ndarray, lengths: np.ndarray) -> None:
        """Append len(lengths) sequences whose values are `values` [sum(lengths)], in order."""
        values = np.ascontiguousarray(values, dtype=self.dtype)
        lengths = np.asarray(lengths, dtype=np.int32)
        if int(lengths.sum()) != values.shape[0]:
            raise ValueError(f"{values.shape[0]} values for sequences of {int(lengths.sum())}")
        self.data_file.write(values.tobytes())
        self.lengths.frombytes(lengths.tobytes())

    def finalize(self, idx_path: str) -> None:
        self.data_file.close()
        n = len(self.lengths)
        lengths = np.frombuffer(self.lengths, dtype=np.int32) if n else np.zeros(0, np.int32)
        with open(idx_path, "wb") as f:
            f.write(INDEX_HEADER + struct.pack("<Q", 1) + struct.pack("<B", DTYPE_CODES[self.dtype]))
            f.write(struct.pack("<Q", n) + struct.pack("<Q", n + 1))
            f.write(lengths.tobytes())
            offset = 0
            for at in range(0, n, _BLOCK):
                block = lengths[at:at + _BLOCK].astype(np.int64) * self.dtype.itemsize
                ends = np.cumsum(block) + offset
                f.write((ends - block).tobytes())
                offset = int(ends[-1])
            for at in range(0, n + 1, _BLOCK):
                f.write(np.arange(at, min(at + _BLOCK, n + 1), dtype=np.int64).tobytes())

    def close(self) -> None:
        """Close the data file without writing an index (after an error)."""
        if not self.data_file.closed:
            self.data_file.close()


__all__ = ["DTYPE_CODES", "INDEX_HEADER", "INDEX_HEADER_BYTES", "IndexedWriter",
           "token_dtype"]
