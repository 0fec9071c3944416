"""HFCheckpoint keeps to its folder: index entries that leave it (`..`, absolute paths, symlinks out)
are refused naming the index and the entry, and a malformed weight_map is a clear error."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.hf_files import INDEX_NAME, SINGLE_NAME, HFCheckpoint


def _shard(path, **tensors):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


@pytest.fixture
def folders(tmp_path):
    """hf/ with two shards and an index; elsewhere/ holding a valid shard outside it."""
    hf, elsewhere = tmp_path / "hf", tmp_path / "elsewhere"
    hf.mkdir()
    elsewhere.mkdir()
    _shard(hf / "a.safetensors", w=torch.ones(2, 3))
    _shard(hf / "b.safetensors", v=torch.zeros(4))
    _shard(elsewhere / "x.safetensors", v=torch.full((4,), 7.0))
    _index(hf, {"w": "a.safetensors", "v": "b.safetensors"})
    return hf, elsewhere


def _index(hf, weight_map):
    with open(hf / INDEX_NAME, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def test_index_inside_the_folder_is_read(folders):
    hf, _ = folders
    ckpt = HFCheckpoint(str(hf))
    assert sorted(ckpt.tensors) == ["v", "w"]
    assert torch.equal(ckpt.read("w"), torch.ones(2, 3))


def test_symlink_inside_the_folder_is_accepted(folders):
    hf, _ = folders
    os.symlink("b.safetensors", hf / "c.safetensors")
    _index(hf, {"w": "a.safetensors", "v": "c.safetensors"})
    assert torch.equal(HFCheckpoint(str(hf)).read("v"), torch.zeros(4))


@pytest.mark.parametrize("entry", ["../elsewhere/x.safetensors", "ABS", "sub/../../elsewhere/x.safetensors"])
def test_entry_outside_the_folder_is_refused(folders, entry):
    hf, elsewhere = folders
    if entry == "ABS":
        entry = str(elsewhere / "x.safetensors")
    (hf / "sub").mkdir()
    assert os.path.isfile(os.path.join(hf, entry))  # it exists: following it would work
    _index(hf, {"w": "a.safetensors", "v": entry})
    with pytest.raises(ConversionError) as info:
        HFCheckpoint(str(hf))
    msg = str(info.value)
    assert INDEX_NAME in msg and "'v'" in msg and repr(entry) in msg and "outside" in msg, msg


def test_symlink_out_of_the_folder_is_refused(folders):
    hf, elsewhere = folders
    os.symlink(elsewhere / "x.safetensors", hf / "link.safetensors")
    _index(hf, {"w": "a.safetensors", "v": "link.safetensors"})
    with pytest.raises(ConversionError, match="symlink") as info:
        HFCheckpoint(str(hf))
    assert INDEX_NAME in str(info.value) and "'v'" in str(info.value)


def test_single_file_symlinked_out_is_refused(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    _shard(tmp_path / "real.safetensors", w=torch.ones(2))
    os.symlink(tmp_path / "real.safetensors", hf / SINGLE_NAME)
    with pytest.raises(ConversionError, match="outside"):
        HFCheckpoint(str(hf))


@pytest.mark.parametrize("weight_map", [
    ["a.safetensors", "b.safetensors"],
    {"w": 3},
    {"w": ["a.safetensors"]},
    "a.safetensors",
    None,
])
def test_weight_map_that_is_not_a_dict_of_strings(folders, weight_map):
    hf, _ = folders
    _index(hf, weight_map)
    with pytest.raises(ConversionError, match="weight_map") as info:
        HFCheckpoint(str(hf))
    assert INDEX_NAME in str(info.value)


def test_index_that_is_not_an_object(folders):
    hf, _ = folders
    with open(hf / INDEX_NAME, "w") as f:
        json.dump([{"weight_map": {}}], f)
    with pytest.raises(ConversionError, match="not a valid safetensors index"):
        HFCheckpoint(str(hf))
