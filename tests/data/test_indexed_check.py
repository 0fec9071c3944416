"""data/indexed_check.py: an indexed prefix whose `.idx` (or `P_targets.idx`, or `P.json`) is
damaged is refused on open with one DataError line naming the file and the problem, never a
megatron-core traceback, and never read as it is."""

import json
import os
import struct

import numpy as np
import pytest

from megatron_lora.data import DataError, load_tokenizer
from megatron_lora.data.indexed import IndexedSamples
from megatron_lora.data.preprocess import preprocess
from megatron_lora.data.sources import open_data

N = 6  # samples of the prefix
# Byte offsets in its .idx: the header is 34 bytes, then lengths int32 [N], pointers int64 [N],
# document boundaries int64 [N + 1].
LENGTHS, POINTERS, DOCS = 34, 34 + 4 * N, 34 + 12 * N


def _prefix(folder):
    """A preprocess prefix of N samples (byte tokenizer: uint16 ids)."""
    path = os.path.join(folder, "d.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": f"q{i} ", "response": f"a{i}"}) + "\n"
                     for i in range(N))
    prefix = os.path.join(folder, "d")
    preprocess([path], "byte", prefix, progress_interval=-1)
    return prefix


def _patch(path, offset, fmt, *values):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, *values))


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def _masks_of_fewer_samples(prefix):
    """P_targets.bin/.idx rewritten, valid, with the loss masks of the first N - 1 samples."""
    from megatron_lora.data.indexed import IndexedSamples
    from megatron_lora.data.indexed_writer import IndexedWriter

    samples = IndexedSamples(prefix)
    masks = [samples.targets(i) for i in range(N - 1)]
    writer = IndexedWriter(prefix + "_targets.bin", np.uint8)
    writer.add(np.concatenate(masks), [m.shape[0] for m in masks])
    writer.finalize(prefix + "_targets.idx")


def _bin_size(prefix):
    return os.path.getsize(prefix + ".bin")


# (name, damage(prefix), which file the message names, what it says)
CASES = [
    ("empty", lambda p: _truncate(p + ".idx", 0), ".idx", "is empty"),
    ("short header", lambda p: _truncate(p + ".idx", 20), ".idx",
     "is truncated (20 bytes, shorter than the 34-byte header)"),
    ("truncated arrays", lambda p: _truncate(p + ".idx", os.path.getsize(p + ".idx") - 8), ".idx",
     f"bytes, but its header's {N} sequences and {N + 1} document boundaries take"),
    ("magic", lambda p: _patch(p + ".idx", 0, "<9s", b"NOTANIDX\x00"), ".idx",
     "does not start with megatron-core's index header"),
    ("version", lambda p: _patch(p + ".idx", 9, "<Q", 2), ".idx", "has version 2"),
    ("dtype code", lambda p: _patch(p + ".idx", 17, "<B", 9), ".idx",
     "has dtype code 9, not one of megatron-core's (1, 2, 3, 4, 5, 6, 7, 8)"),
    ("float dtype", lambda p: _patch(p + ".idx", 17, "<B", 7), ".idx",
     "holds float32 values (dtype code 7); token ids must be uint8 (1), int8 (2)"),
    ("documents beyond the file", lambda p: _patch(p + ".idx", 26, "<Q", 10 ** 6), ".idx",
     f"but its header's {N} sequences and 1000000 document boundaries take"),
    ("sequences beyond the file", lambda p: _patch(p + ".idx", 18, "<Q", 2 ** 40), ".idx",
     "but its header's 1099511627776 sequences"),
    ("no documents", lambda p: (_patch(p + ".idx", 26, "<Q", 0),
                                _truncate(p + ".idx", DOCS)), ".idx",
     "has no document boundaries"),
    ("document index beyond the sequences", lambda p: _patch(p + ".idx", DOCS + 8 * N, "<q",
                                                             N + 5), ".idx",
     f"has document boundaries ending at {N + 5}, not at its {N} sequences"),
    ("decreasing document index", lambda p: _patch(p + ".idx", DOCS + 16, "<q", 0), ".idx",
     "has decreasing document boundaries (boundary 2 is 0, after 1)"),
    ("negative document index", lambda p: _patch(p + ".idx", DOCS, "<q", -1), ".idx",
     "has document boundaries starting at -1, not 0"),
    ("negative length", lambda p: _patch(p + ".idx", LENGTHS + 8, "<i", -3), ".idx",
     "gives sequence 2 the length -3 (below 0)"),
    ("negative pointer", lambda p: _patch(p + ".idx", POINTERS + 24, "<q", -8), ".idx",
     "places sequence 3 at bytes -8.."),
    ("pointer past the end", lambda p: _patch(p + ".idx", POINTERS + 8 * (N - 1), "<q",
                                              _bin_size(p) - 2), ".idx",
     "outside its"),
    ("pointer between two ids", lambda p: _patch(p + ".idx", POINTERS + 8, "<q", 7), ".idx",
     "places sequence 1 at byte 7 of "),  # uint16 ids: read from byte 7, beyond the vocabulary
    ("huge pointer", lambda p: _patch(p + ".idx", POINTERS, "<q", 2 ** 63 - 1), ".idx",
     "places sequence 0 at bytes 9223372036854775807.."),
    ("loss-mask pointer past the end", lambda p: _patch(
        p + "_targets.idx", POINTERS + 8, "<q", 10 ** 6), "_targets.idx",
     "places sequence 1 at bytes 1000000.."),
    ("loss-mask dtype", lambda p: _patch(p + "_targets.idx", 17, "<B", 4), "_targets.idx",
     "holds int32 values (dtype code 4); loss masks must be uint8 (1)"),
    ("loss-mask sequence count", lambda p: _masks_of_fewer_samples(p), "_targets.idx",
     None),  # a valid index of its own, but of N - 1 sequences
]


@pytest.mark.parametrize("name,damage,suffix,message", CASES, ids=[c[0] for c in CASES])
def test_a_damaged_index_is_one_data_error_naming_it(tmp_path, name, damage, suffix, message):
    prefix = _prefix(str(tmp_path))
    damage(prefix)
    with pytest.raises(DataError) as info:
        open_data([prefix], load_tokenizer("byte"), 16, seed=1)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"--data-path {prefix}: {prefix}{suffix} "), text
    if message is not None:
        assert message in text, text
    else:
        assert f"has {N - 1} sequences, {prefix}.idx {N}" in text, text


def test_a_damaged_validation_prefix_names_its_flag(tmp_path):
    prefix = _prefix(str(tmp_path))
    _patch(prefix + ".idx", DOCS + 16, "<q", 0)
    with pytest.raises(DataError, match=rf"^--valid-data-path {prefix}: {prefix}\.idx has "
                                        r"decreasing document boundaries"):
        open_data([prefix], load_tokenizer("byte"), 16, seed=1, flag="--valid-data-path")


@pytest.mark.parametrize("meta,message", [
    ([1, 2], "expected a JSON object (what `megatron-lora preprocess` writes), got list"),
    ({"vocab_size": "259"}, "'vocab_size' must be an integer, got the string \"259\""),
    ({"bos_id": 1.5}, "'bos_id' must be an integer or null, got 1.5"),
    ({"pad_id": True}, "'pad_id' must be an integer, got true"),
])
def test_a_metadata_file_of_the_wrong_type_is_refused(tmp_path, meta, message):
    prefix = _prefix(str(tmp_path))
    if isinstance(meta, dict):
        with open(prefix + ".json") as f:
            meta = {**json.load(f), **meta}
    with open(prefix + ".json", "w") as f:
        json.dump(meta, f)
    with pytest.raises(DataError) as info:
        open_data([prefix], load_tokenizer("byte"), 16, seed=1)
    assert str(info.value) == f"--data-path {prefix}: {prefix}.json: {message}" + (
        "; remove it or preprocess again" if isinstance(meta, list) else
        "; run `megatron-lora preprocess` again")


def test_negative_token_ids_of_a_signed_dtype_are_refused(tmp_path):
    """int16 ids are a valid dtype, but -1 is no token: refused before the embedding sees it."""
    prefix = _prefix(str(tmp_path))
    _patch(prefix + ".idx", 17, "<B", 3)  # uint16 -> int16: the same bytes
    _patch(prefix + ".bin", 2, "<h", -1)
    assert IndexedSamples(prefix).token_range()[0] == -1
    with pytest.raises(DataError, match=rf"^--data-path {prefix}: {prefix}\.bin holds the "
                                        r"negative token id -1"):
        open_data([prefix], load_tokenizer("byte"), 16, seed=1)


def test_a_large_index_is_checked_in_blocks(tmp_path, monkeypatch):
    """The checks see every entry whatever the block size (a problem in the last block of
    several, and across a block boundary), and a valid index passes."""
    import megatron_lora.data.indexed_check as check

    prefix = _prefix(str(tmp_path))
    monkeypatch.setattr(check, "_BLOCK", 2)
    assert len(IndexedSamples(prefix)) == N
    _patch(prefix + ".idx", DOCS + 8 * 4, "<q", 2)  # boundary 4 < boundary 3, next block
    with pytest.raises(DataError, match="boundary 4 is 2, after 3"):
        IndexedSamples(prefix)
    _patch(prefix + ".idx", DOCS + 8 * 4, "<q", 4)
    _patch(prefix + ".idx", LENGTHS + 4 * (N - 1), "<i", 10 ** 6)
    with pytest.raises(DataError, match=f"places sequence {N - 1} at bytes"):
        IndexedSamples(prefix)


def test_megatron_lm_prefixes_still_open(tmp_path):
    """A prefix megatron-core's own builder writes (several sequences per document, int32 ids)
    passes the checks."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "mlm")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    builder.add_document(np.array([256, 5, 6, 257, 256, 7, 257]), [4, 3])
    builder.add_document(np.array([256, 9, 257]), [3])
    builder.finalize(prefix + ".idx")
    samples = IndexedSamples(prefix, load_tokenizer("byte"))
    assert samples.lengths.tolist() == [4, 3, 3] and samples.tokens(1).tolist() == [256, 7, 257]


@pytest.mark.parametrize("suffix", [".bin", ".idx", "_targets.bin", ".json"])
def test_a_fifo_in_a_prefix_is_refused_without_opening_it(tmp_path, suffix):
    """A FIFO would block the first open (nothing writes to it): the check must not open it.
    Guarded by a thread with a timeout, so a regression fails instead of hanging."""
    import threading

    prefix = _prefix(str(tmp_path))
    os.unlink(prefix + suffix)
    os.mkfifo(prefix + suffix)
    result = {}

    def run():
        try:
            open_data([prefix], load_tokenizer("byte"), 16, seed=1)
        except DataError as exc:
            result["error"] = str(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=30)
    if worker.is_alive():  # unblock the open so the thread can end
        with open(prefix + suffix, "wb"):
            pass
        pytest.fail(f"open_data blocked on the FIFO {prefix + suffix}")
    assert result["error"] == f"--data-path {prefix}: " + (
        f"{prefix}.json: cannot read: " if suffix == ".json" else
        f"cannot read {prefix + suffix}: ") + "a FIFO (named pipe), not a regular file"
