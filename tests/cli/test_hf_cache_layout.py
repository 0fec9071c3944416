"""A model in the Hugging Face hub cache layout (snapshots/REV/* -> ../../blobs/HASH) converts
through the CLI; a snapshot file linked to another repo's blobs is refused naming it."""

import hashlib
import os

import pytest

from megatron_lora.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_example):
    return tiny_example(tmp_path_factory.mktemp("hf_cache"), samples=4)


def _cache(hf, hub, repo="models--org--tiny-mixtral"):
    """The files of folder `hf` as the hub cache stores them: content-named blobs, and a
    snapshot of relative symlinks to them. Returns the snapshot folder."""
    snap = os.path.join(hub, repo, "snapshots", "3f2c1a")
    blobs = os.path.join(hub, repo, "blobs")
    os.makedirs(snap)
    os.makedirs(blobs, exist_ok=True)
    for name in sorted(os.listdir(hf)):
        data = open(os.path.join(hf, name), "rb").read()
        blob = hashlib.sha256(data).hexdigest()
        with open(os.path.join(blobs, blob), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snap, name))
    return snap


def test_hub_cache_snapshot_converts(tiny, tmp_path, capsys):
    snap = _cache(os.path.join(tiny, "hf"), str(tmp_path / "hub"))
    assert all(os.path.islink(os.path.join(snap, n)) for n in os.listdir(snap))
    code = main(["convert", "hf-to-mcore", "--hf-dir", snap, "--save", str(tmp_path / "out"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0, err[-2000:]
    assert os.path.isfile(tmp_path / "out" / ".metadata")


def test_snapshot_linked_to_another_repos_blob_is_refused(tiny, tmp_path, capsys):
    hub = str(tmp_path / "hub")
    snap = _cache(os.path.join(tiny, "hf"), hub)
    other = _cache(os.path.join(tiny, "hf"), hub, repo="models--someone--else")
    shard = sorted(n for n in os.listdir(snap) if n.endswith(".safetensors"))[0]
    target = os.path.realpath(os.path.join(other, shard))
    os.remove(os.path.join(snap, shard))
    os.symlink(os.path.relpath(target, snap), os.path.join(snap, shard))
    code = main(["convert", "hf-to-mcore", "--hf-dir", snap, "--save", str(tmp_path / "out"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert f"resolves to {target}, outside {os.path.realpath(snap)}" in err, err
    assert repr(shard) in err and not os.path.exists(tmp_path / "out")
