"""Every command that reads a checkpoint, given one whose `.metadata`, common.pt or data file
holds a payload that creates a marker file when unpickled: the payload never runs, every rank exits
with status 2, and no rank prints a traceback. A payload in the per-rank `rng/` folder older
versions wrote is never read at all: the resume trains, the payload does not run.

Commands refused on one rank before any collective run in this process, through `main` (what
`python -m megatron_lora` calls). Multi-rank cases start each rank as its own process (the torchrun
environment by hand), so each rank's exit status and stderr are checked; every run has a timeout,
so a rank left waiting in a collective fails the test instead of hanging it.
"""

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys

import pytest
from torch.distributed.checkpoint import filesystem as dcp_fs

from tests.runtime.hostile import metadata_payloads, run_unsafely, torch_payloads

LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-target-modules", "linear_qkv",
        "linear_proj"]


def _env(**extra):
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", **extra)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args, ranks=1, timeout=240):
    """[(returncode, stderr)] of `python -m megatron_lora ARGS` on each of `ranks` ranks."""
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "megatron_lora", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
             for r in range(ranks)]
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:  # a rank left waiting: fail, do not hang the suite
                p.kill()
                p.wait()
    return out


@pytest.fixture(scope="module")
def good(tmp_path_factory, tiny_example):
    """A tiny HF Mixtral and its data, its torch_dist conversion and a 1-step adapter run saved
    by 2 ranks."""
    root = tmp_path_factory.mktemp("hostile")
    tiny_example(root, samples=32, mcore=True)
    paths = {"hf": str(root / "hf"), "data": str(root / "data.jsonl"),
             "mcore": str(root / "mcore"), "run": str(root / "run"),
             "tokens": str(root / "tokens.json")}
    json.dump([[1, 2, 3, 4, 5, 6, 7, 8]], open(paths["tokens"], "w"))
    results = _run(_train_args(paths, paths["run"], 1), ranks=2)
    assert all(rc == 0 for rc, _ in results), results[0][1][-3000:]
    assert not os.path.exists(os.path.join(paths["run"], "iter_0000001", "rng"))  # no RNG state
    return paths


def _train_args(paths, save, iters, source=("--load-hf",)):
    load = ["--load-hf", paths["hf"]] if source == ("--load-hf",) else list(source)
    return ["train", *load, "--data-path", paths["data"], "--tokenizer", "byte",
            "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", str(iters), "--lr", "1e-3", "--log-interval", "1", "--seed", "3",
            "--save", save, *LORA]


def _hostile_copy(src, dst, which, marker):
    """A copy of checkpoint folder `src` with one file replaced by a payload."""
    shutil.copytree(src, dst)
    if which == "metadata":
        data = metadata_payloads(marker)["dotted_dcp_metadata_os_system"]
        kind, path = "metadata", os.path.join(dst, ".metadata")
    elif which == "common":
        data = torch_payloads(marker)["zip_common"]
        kind, path = "torch", os.path.join(dst, "common.pt")
    elif which == "rng_rank1":  # as an older version wrote it, one rank's file
        data = torch_payloads(marker)["zip_rng"]
        kind, path = "torch", os.path.join(dst, "rng", "rank_00001.pt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
    elif which == "chunk":  # one stored tensor (an optimizer state where there is one) replaced
        data = torch_payloads(marker)["zip_optimizer_state"]
        kind, path = "torch", os.path.join(dst, "hostile.distcp")
        md_path = os.path.join(dst, ".metadata")
        with open(md_path, "rb") as f:
            md = pickle.load(f)  # our own checkpoint's metadata, written by the fixture
        keys = sorted(md.storage_data, key=lambda i: (not i.fqn.startswith("optimizer."), i.fqn))
        for index in keys:
            md.storage_data[index] = dcp_fs._StorageInfo("hostile.distcp", 0, len(data))
        with open(md_path, "wb") as f:
            pickle.dump(md, f)
    else:
        raise AssertionError(which)
    with open(path, "wb") as f:
        f.write(data)
    return kind, data


def _assert_refused(results, marker, kind, data, *needles):
    assert not os.path.exists(marker), "the payload ran"
    for rank, (rc, err) in enumerate(results):
        assert rc == 2, f"rank {rank} exited {rc}: {err[-3000:]}"
        assert "Traceback" not in err, f"rank {rank}: {err[-3000:]}"
        for needle in needles:
            assert needle in err, f"rank {rank}: {err[-3000:]}"
    run_unsafely(kind, data)
    assert os.path.exists(marker), "the payload is not hostile: the test proves nothing"


def _needle(which):
    return {"metadata": ".metadata", "common": "common.pt", "chunk": "hostile.distcp"}[which]


def _in_process(args, capsys):
    """Commands that read a checkpoint in one process, run in this one (as the suite's other CLI
    tests do): [(exit status, stderr)]."""
    from megatron_lora.cli import main

    rc = main(args)
    return [(rc, capsys.readouterr().err)]


@pytest.mark.parametrize("command,which", [
    ("convert mcore-to-hf", "metadata"),
    ("convert mcore-to-hf", "chunk"),
    ("export hf --merge (base)", "common"),
    ("export hf --merge (adapter)", "metadata"),
    ("export peft", "common"),
    ("export peft", "chunk"),
])
def test_hostile_checkpoint_one_process_commands(good, tmp_path, capsys, command, which):
    marker, bad, out = str(tmp_path / "marker"), str(tmp_path / "bad"), str(tmp_path / "out")
    adapter = os.path.join(good["run"], "iter_0000001")
    base_side = command in ("convert mcore-to-hf", "export hf --merge (base)")
    kind, data = _hostile_copy(good["mcore"] if base_side else adapter, bad, which, marker)
    args = {
        "convert mcore-to-hf": ["convert", "mcore-to-hf", "--load", bad, "--save", out,
                                "--no-progress"],
        "export hf --merge (base)": ["export", "hf", "--load", bad, "--adapter", adapter,
                                     "--merge", "--save", out, "--no-progress"],
        "export hf --merge (adapter)": ["export", "hf", "--load", good["mcore"], "--adapter", bad,
                                        "--merge", "--save", out, "--no-progress"],
        "export peft": ["export", "peft", "--adapter", bad, "--load-hf", good["hf"],
                        "--save", out],
    }[command]
    _assert_refused(_in_process(args, capsys), marker, kind, data, _needle(which))
    assert not os.path.exists(out)


@pytest.mark.parametrize("command,which", [
    ("logits --load", "metadata"),
    ("logits --adapter", "common"),
    ("train --load", "metadata"),
])
def test_hostile_checkpoint_distributed_commands(good, tmp_path, capsys, monkeypatch, command,
                                                 which):
    """The commands torchrun starts, as one rank: the checkpoint is read (and refused) before the
    process group is made, so they run in this process with a one-rank environment."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                 ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port()))):
        monkeypatch.setenv(k, v)
    marker, bad, out = str(tmp_path / "marker"), str(tmp_path / "bad"), str(tmp_path / "out")
    adapter = os.path.join(good["run"], "iter_0000001")
    kind, data = _hostile_copy(adapter if command == "logits --adapter" else good["mcore"], bad,
                               which, marker)
    args = {
        "logits --load": ["logits", "--load", bad, "--tokens", good["tokens"], "--out", out],
        "logits --adapter": ["logits", "--load", good["mcore"], "--adapter", bad, "--tokens",
                             good["tokens"], "--out", out],
        "train --load": _train_args(good, out, 1, source=("--load", bad)),
    }[command]
    _assert_refused(_in_process(args, capsys), marker, kind, data, _needle(which))
    assert not os.path.exists(out)


@pytest.mark.parametrize("which,ranks", [("rng_rank1", 2), ("chunk", 1)])
def test_hostile_checkpoint_on_resume(good, tmp_path, which, ranks):
    """train resuming from its --save folder. rng_rank1: on the 2 ranks the run was saved with,
    rank 1's file of an older version's rng/ folder is a payload: never read, so both ranks
    train iteration 2. chunk: a stored tensor (an Adam moment) read by megatron's loader."""
    marker, save = str(tmp_path / "marker"), str(tmp_path / "run")
    os.makedirs(save)
    shutil.copy(os.path.join(good["run"], "latest_checkpointed_iteration.txt"), save)
    kind, data = _hostile_copy(os.path.join(good["run"], "iter_0000001"),
                               os.path.join(save, "iter_0000001"), which, marker)
    results = _run(_train_args(good, save, 2), ranks=ranks)
    if which == "rng_rank1":
        for rank, (rc, err) in enumerate(results):
            assert rc == 0 and "Traceback" not in err, f"rank {rank} exited {rc}: {err[-3000:]}"
        assert not os.path.exists(marker), "the payload ran"
        assert os.path.isdir(os.path.join(save, "iter_0000002"))
        run_unsafely(kind, data)
        assert os.path.exists(marker), "the payload is not hostile: the test proves nothing"
        return
    _assert_refused(results, marker, kind, data, "hostile.distcp", "nothing in it was run")
    assert not os.path.exists(os.path.join(save, "iter_0000002"))
