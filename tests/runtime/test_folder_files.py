"""runtime.folder_files: a folder's files must resolve inside it, except a Hugging Face cache
snapshot's links to its own repo's blobs; HF model files and checkpoint files are checked so."""

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from megatron_lora.runtime.safe_load import CheckpointFileError, check_checkpoint


def _cache(root, repo="models--org--tiny"):
    """root/repo/{blobs,snapshots/rev}: the hub cache's layout."""
    blobs, snap = root / repo / "blobs", root / repo / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    return blobs, snap


def test_inside_and_outside(tmp_path):
    from megatron_lora.runtime.folder_files import (FolderFileError, check_in_folder,
                                                    outside_folder)

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "a.json").write_text("{}")
    (tmp_path / "secret").write_text("x")
    os.symlink("a.json", folder / "b.json")
    os.symlink(tmp_path / "secret", folder / "c.json")
    assert outside_folder(str(folder), str(folder / "a.json")) is None
    assert outside_folder(str(folder), str(folder / "b.json")) is None
    assert outside_folder(str(folder), str(folder / "c.json")) == str(tmp_path / "secret")
    with pytest.raises(FolderFileError) as info:
        check_in_folder(str(folder), str(folder / "c.json"))
    message = str(info.value)
    assert "\n" not in message
    for part in (str(folder / "c.json"), f"resolves to {tmp_path / 'secret'}",
                 f"outside the folder {folder}"):
        assert part in message, message


def test_hub_cache_snapshot_may_link_to_its_own_blobs(tmp_path):
    from megatron_lora.runtime.folder_files import check_in_folder, outside_folder

    blobs, snap = _cache(tmp_path)
    (blobs / "abc123").write_text("{}")
    os.symlink("../../blobs/abc123", snap / "config.json")
    (snap / "sub").mkdir()
    os.symlink("../../../blobs/abc123", snap / "sub" / "x.jinja")
    assert check_in_folder(str(snap), str(snap / "config.json")) == str(snap / "config.json")
    assert outside_folder(str(snap), str(snap / "sub" / "x.jinja")) is None
    assert outside_folder(str(snap / "sub"), str(snap / "sub" / "x.jinja")) is None
    # a folder that links to the snapshot (a user's ./mixtral -> the cache) is the snapshot
    os.symlink(snap, tmp_path / "alias")
    assert outside_folder(str(tmp_path / "alias"), str(tmp_path / "alias" / "config.json")) is None


def test_hub_cache_snapshot_may_not_link_elsewhere(tmp_path):
    from megatron_lora.runtime.folder_files import check_in_folder, outside_folder

    blobs, snap = _cache(tmp_path)
    other_blobs, _ = _cache(tmp_path, "models--other--repo")
    (other_blobs / "f00d").write_text("{}")
    (blobs / "deeper").mkdir()
    (blobs / "deeper" / "x").write_text("{}")
    (tmp_path / "secret").write_text("x")
    for name, target in (("config.json", "../../../models--other--repo/blobs/f00d"),
                         ("a.json", "../../blobs/deeper/x"), ("b.json", str(tmp_path / "secret"))):
        os.symlink(target, snap / name)
        assert outside_folder(str(snap), str(snap / name)) is not None, name
    # a plain folder that only looks like blobs is no snapshot
    plain = tmp_path / "plain"
    plain.mkdir()
    os.symlink(blobs / "deeper" / "x", plain / "config.json")
    assert outside_folder(str(plain), str(plain / "config.json")) is not None


# --- the HF model files ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf(tmp_path_factory, tiny_example):
    return os.path.join(tiny_example(tmp_path_factory.mktemp("folder_files"), samples=4), "hf")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json",
                                  "tokenizer.model"])
def test_hf_model_file_symlinked_out_is_refused(hf, tmp_path, name):
    """config.json, the index and a file hf-to-mcore copies (tokenizer.model): a link out is
    refused naming the file and where it resolves, before any output exists."""
    from megatron_lora.convert.errors import ConversionError
    from megatron_lora.convert.hf_to_mcore import hf_to_mcore
    from megatron_lora.families import ModelConfigError

    copy = tmp_path / "hf"
    shutil.copytree(hf, copy)
    outside = tmp_path / "outside"
    outside.mkdir()
    source = copy / name if (copy / name).exists() else None
    target = outside / name
    if source is not None:
        shutil.move(source, target)
    else:
        target.write_bytes(b"not a tokenizer")
    os.symlink(target, copy / name)
    with pytest.raises((ConversionError, ModelConfigError)) as info:
        hf_to_mcore(str(copy), str(tmp_path / "out"), progress=False)
    message = str(info.value)
    assert f"{copy / name} resolves to {target}, outside the folder {copy}" in message, message
    assert not os.path.exists(tmp_path / "out")


# --- the checkpoint files ----------------------------------------------------------------------

def _checkpoint(directory):
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(directory), no_dist=True)
    torch.save({"common": {"iteration": 1}}, os.path.join(directory, "common.pt"))
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist"}, f)


@pytest.mark.parametrize("name", [".metadata", "common.pt", "metadata.json"])
def test_checkpoint_file_symlinked_out_is_refused(tmp_path, name):
    ckpt, outside = tmp_path / "iter_0000001", tmp_path / "outside"
    ckpt.mkdir()
    outside.mkdir()
    _checkpoint(ckpt)
    check_checkpoint(str(ckpt))  # the plain checkpoint reads
    shutil.move(ckpt / name, outside / name)
    os.symlink(outside / name, ckpt / name)
    with pytest.raises(CheckpointFileError) as info:
        check_checkpoint(str(ckpt))
    message = str(info.value)
    assert message.startswith(f"{ckpt / name}: resolves to {outside / name}, outside the "
                              f"checkpoint folder {ckpt}"), message


def test_tracker_symlinked_out_is_refused_without_reading_it(tmp_path):
    from megatron_lora.training.checkpoint import TRACKER, CheckpointError, read_tracker

    run = tmp_path / "run"
    (run / "iter_0000001").mkdir(parents=True)
    (tmp_path / "secret").write_text("the contents of another file\n")
    os.symlink(tmp_path / "secret", run / TRACKER)
    with pytest.raises(CheckpointError) as info:
        read_tracker(str(run))
    assert f"resolves to {tmp_path / 'secret'}" in str(info.value)
    assert "the contents" not in str(info.value)


@pytest.mark.parametrize("name", ["hf_config.json", os.path.join("hf_files", "secret.txt")])
def test_converted_checkpoint_file_symlinked_out_is_refused(tmp_path, tiny_example, name):
    """mcore-to-hf reads hf_config.json and copies every file of hf_files/ into its output: a
    link out of the checkpoint would copy a file of the machine there."""
    from megatron_lora.convert.errors import ConversionError
    from megatron_lora.convert.mcore_to_hf import mcore_to_hf

    mcore = os.path.join(tiny_example(tmp_path / "t", samples=4, mcore=True), "mcore")
    os.makedirs(os.path.join(mcore, "hf_files"), exist_ok=True)
    target = tmp_path / "outside"
    if os.path.exists(os.path.join(mcore, name)):
        shutil.move(os.path.join(mcore, name), target)
    else:
        target.write_text("not the checkpoint's")
    os.symlink(target, os.path.join(mcore, name))
    with pytest.raises(ConversionError) as info:
        mcore_to_hf(mcore, str(tmp_path / "out"), progress=False)
    assert f"{os.path.join(mcore, name)} resolves to {target}, outside the folder" in str(
        info.value), str(info.value)
    assert not os.path.exists(tmp_path / "out")
