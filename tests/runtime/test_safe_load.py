"""runtime.safe_load: every hostile file of the corpus is refused, names the file and runs nothing;
legitimate checkpoint files (torch's own DCP writer, megatron-core's dist_checkpointing.save) load.

Each hostile case also reads the same bytes the unsafe way afterwards and asserts that the marker
then appears: the corpus really is hostile, so a reader that ran it would fail the test."""

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_fs

from megatron_lora.runtime.safe_load import (
    CheckpointFileError,
    SafeFileSystemReader,
    check_checkpoint,
    confined_path,
    load_common_state,
    load_dcp_metadata,
    safe_torch_load,
)
from tests.runtime.hostile import metadata_payloads, run_unsafely, torch_payloads

METADATA = sorted(metadata_payloads("m"))
TORCH = sorted(torch_payloads("m"))


def _assert_refused(call, path, marker, kind, data):
    with pytest.raises(CheckpointFileError) as info:
        call()
    message = str(info.value)
    assert path in message and "\n" not in message, message
    assert not os.path.exists(marker), "the payload ran"
    run_unsafely(kind, data)
    assert os.path.exists(marker), "the corpus entry is not hostile: the test proves nothing"


@pytest.mark.parametrize("name", METADATA)
def test_hostile_metadata_is_refused(tmp_path, name):
    marker = str(tmp_path / "marker")
    data = metadata_payloads(marker)[name]
    path = tmp_path / ".metadata"
    path.write_bytes(data)
    _assert_refused(lambda: load_dcp_metadata(str(tmp_path)), str(path), marker, "metadata", data)


@pytest.mark.parametrize("name", METADATA[:3])
def test_hostile_metadata_through_the_reader(tmp_path, name):
    """The FileSystemReader handed to torch's DCP load, global and rank-local metadata."""
    marker = str(tmp_path / "marker")
    data = metadata_payloads(marker)[name]
    (tmp_path / ".metadata").write_bytes(data)
    (tmp_path / "__1.metadata").write_bytes(data)
    reader = SafeFileSystemReader(str(tmp_path))
    with pytest.raises(CheckpointFileError, match="__1.metadata"):
        reader.read_metadata(rank=1)
    _assert_refused(reader.read_metadata, str(tmp_path / ".metadata"), marker, "metadata", data)


@pytest.mark.parametrize("name", TORCH)
def test_hostile_torch_file_is_refused(tmp_path, name):
    marker = str(tmp_path / "marker")
    data = torch_payloads(marker)[name]
    path = tmp_path / "common.pt"
    path.write_bytes(data)
    _assert_refused(lambda: load_common_state(str(tmp_path)), str(path), marker, "torch", data)


@pytest.mark.parametrize("name", ["zip_rng", "zip_optimizer_state", "legacy_format"])
def test_hostile_torch_file_object(tmp_path, name):
    """safe_torch_load on an open file object (how a chunk is read from a data file)."""
    marker = str(tmp_path / "marker")
    data = torch_payloads(marker)[name]
    path = tmp_path / "rank_00000.pt"
    path.write_bytes(data)
    with open(path, "rb") as f:
        _assert_refused(lambda: safe_torch_load(f, str(path)), str(path), marker, "torch", data)


def _dcp_checkpoint(directory):
    """A real checkpoint written by torch's own DCP writer (no process group needed)."""
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(2, dtype=torch.bfloat16)}
    dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    return state


def test_torch_dcp_metadata_loads(tmp_path):
    _dcp_checkpoint(tmp_path)
    md = load_dcp_metadata(str(tmp_path))
    assert sorted(md.state_dict_metadata) == ["b", "w"]
    assert list(md.state_dict_metadata["w"].size) == [3, 4]
    assert md.state_dict_metadata["b"].properties.dtype == torch.bfloat16
    reader = SafeFileSystemReader(str(tmp_path))
    out = {"w": torch.zeros(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)}
    dcp.load(out, storage_reader=reader, no_dist=True)  # tensors through the safe reader
    assert torch.equal(out["w"], torch.arange(12.0).reshape(3, 4))


def test_megatron_saved_checkpoint_loads(tiny_reference):
    """dist_checkpointing.save's own files (testing.reference.save_weights) pass the allow-list."""
    md, common = check_checkpoint(os.path.join(tiny_reference, "weights"))
    assert any(k.startswith("decoder.layers.") for k in md.state_dict_metadata)
    assert isinstance(common, dict)


def _with_relative_path(directory, relative):
    _dcp_checkpoint(directory)
    path = os.path.join(directory, ".metadata")
    with open(path, "rb") as f:
        md = pickle.load(f)  # our own file, just written
    for index, info in md.storage_data.items():
        md.storage_data[index] = dcp_fs._StorageInfo(relative, info.offset, info.length)
        break
    with open(path, "wb") as f:
        pickle.dump(md, f)


@pytest.mark.parametrize("relative", ["../elsewhere/x.distcp", "/etc/passwd", "a/../../x"])
def test_data_file_outside_the_folder_is_refused(tmp_path, relative):
    ckpt = tmp_path / "ckpt"
    _with_relative_path(str(ckpt), relative)
    with pytest.raises(CheckpointFileError, match="outside") as info:
        load_dcp_metadata(str(ckpt))
    assert ".metadata" in str(info.value) and repr(relative) in str(info.value)


def test_data_file_symlinked_out_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    (tmp_path / "elsewhere.distcp").write_bytes(b"")
    _with_relative_path(str(ckpt), "link.distcp")
    os.symlink(tmp_path / "elsewhere.distcp", ckpt / "link.distcp")
    with pytest.raises(CheckpointFileError, match="symlink"):
        load_dcp_metadata(str(ckpt))


def test_confined_path_accepts_files_inside(tmp_path):
    (tmp_path / "sub").mkdir()
    assert confined_path(str(tmp_path), "sub/x.bin", "src", "f") == os.path.join(str(tmp_path), "sub/x.bin")
    for bad in ("", None, 3, "..", "sub/../../x"):
        with pytest.raises(CheckpointFileError, match="src"):
            confined_path(str(tmp_path), bad, "src", "f")


def test_not_metadata_and_truncated_files(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(CheckpointFileError, match="holds a dict, not checkpoint Metadata"):
        load_dcp_metadata(str(tmp_path))
    _dcp_checkpoint(tmp_path / "ok")
    path.write_bytes((tmp_path / "ok" / ".metadata").read_bytes()[:-20])
    with pytest.raises(CheckpointFileError, match="not plain checkpoint metadata"):
        load_dcp_metadata(str(tmp_path))
    os.remove(path)
    with pytest.raises(CheckpointFileError, match="missing"):
        load_dcp_metadata(str(tmp_path))
