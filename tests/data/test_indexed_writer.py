"""data/indexed_writer.py: the files are megatron-core's IndexedDatasetBuilder's, byte for byte,
and megatron-core's IndexedDataset reads them back."""

import numpy as np
import pytest

from megatron_lora.data import indexed_writer
from megatron_lora.data.indexed_writer import IndexedWriter, token_dtype


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8])
def test_the_files_are_megatron_cores_byte_for_byte(tmp_path, monkeypatch, dtype):
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    monkeypatch.setattr(indexed_writer, "_BLOCK", 3)  # offsets written over several blocks
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 250, n).astype(dtype) for n in (5, 1, 0, 9, 3, 7, 2, 4)]
    theirs = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=dtype)
    for doc in docs:
        theirs.add_document(doc, [doc.size])
    theirs.finalize(str(tmp_path / "m.idx"))
    ours = IndexedWriter(str(tmp_path / "o.bin"), dtype)
    ours.add(np.concatenate(docs[:3]), [d.size for d in docs[:3]])  # in chunks of samples
    ours.add(np.zeros(0, dtype), [])
    ours.add(np.concatenate(docs[3:]), [d.size for d in docs[3:]])
    ours.finalize(str(tmp_path / "o.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"o{suffix}").read_bytes() == (tmp_path / f"m{suffix}").read_bytes()
    back = IndexedDataset(str(tmp_path / "o"), mmap=True)
    assert len(back) == len(docs) and all(np.array_equal(back[i], d) for i, d in enumerate(docs))


def test_dtype_and_length_errors(tmp_path):
    from megatron.core.datasets.indexed_dataset import DType

    for vocab in (259, 65499, 65500, 150000):
        assert token_dtype(vocab) == np.dtype(DType.optimal_dtype(vocab))
    writer = IndexedWriter(str(tmp_path / "x.bin"), np.uint16)
    with pytest.raises(ValueError, match="3 values for sequences of 4"):
        writer.add(np.zeros(3), [2, 2])
    writer.close()
    with pytest.raises(ValueError, match="cannot hold"):
        IndexedWriter(str(tmp_path / "y.bin"), np.uint32)
