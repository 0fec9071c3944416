"""Checkpoints across megatron-core releases: a base and an adapter checkpoint written under one
supported release load under another and give the same logits, and a run resumes there.

The other release lives in the repository's other environment (`.venv` holds the default release,
`make test MCORE=0.19.2` builds `.venv-mcore0.19.2`); the test runs the commands with both
interpreters. CI builds both environments, so this runs there in the second suite run.
"""

import concurrent.futures
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megatron_lora.testing import compare

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 600


def _mcore_version(python: str) -> str:
    out = subprocess.run([python, "-c", "import importlib.metadata as m; "
                          "print(m.version('megatron-core'))"],
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip() if out.returncode == 0 else ""


def _other_environment():
    """(python, release) of a repository environment with another megatron-core release."""
    ours = _mcore_version(sys.executable)
    here = os.path.realpath(sys.prefix)
    for venv in [os.path.join(ROOT, ".venv")] + sorted(glob.glob(os.path.join(ROOT, ".venv-mcore*"))):
        python = os.path.join(venv, "bin", "python")
        if (os.path.realpath(venv) == here or not os.path.isfile(os.path.join(venv, ".installed"))
                or not os.access(python, os.X_OK)):
            continue
        release = _mcore_version(python)
        if release and release != ours:
            return python, release
    return None, None


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(python, *args, cwd=None):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=_free_port())
    proc = subprocess.run([python, "-m", "megatron_lora", *args], capture_output=True, text=True,
                          env=env, timeout=TIMEOUT_S, cwd=cwd or ROOT)
    assert proc.returncode == 0, f"{python} {' '.join(args)}:\n{proc.stderr[-3000:]}"
    return proc


def _train(python, tiny, base, save, iters):
    return _run(python, "train", "--load", base, "--hf-config", os.path.join(tiny, "hf"),
                "--data-path", os.path.join(tiny, "data.jsonl"), "--tokenizer", "byte",
                "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "2",
                "--train-iters", str(iters), "--lr", "5e-3", "--lora-rank", "4",
                "--lora-alpha", "8", "--lora-dropout", "0.1", "--save", save,
                "--log-interval", "1", "--seed", "3",
                "--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _logits(python, base, adapter, tokens, out):
    _run(python, "logits", "--load", base, "--adapter", adapter, "--tokens", tokens, "--out", out)
    return load_file(out)["logits"]


@pytest.fixture(scope="module")
def environments():
    other, release = _other_environment()
    if other is None:
        pytest.skip("needs a second environment with another megatron-core release "
                    "(`make test MCORE=0.19.2` builds .venv-mcore0.19.2, and CI runs both)")
    return {"ours": (sys.executable, _mcore_version(sys.executable)), "other": (other, release)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_example):
    out = tmp_path_factory.mktemp("cross_release")
    tiny_example(out, samples=32)
    with open(out / "tokens.json", "w") as f:
        json.dump([[1, 5, 9, 77, 120, 33, 2, 8], [4, 4, 200, 17, 6, 90, 11, 3]], f)
    return str(out)


def _direction(writer, reader, tiny, root):
    """Every command of one direction, in order: the writing release converts, trains 2 steps and
    computes logits; the reading release computes logits with and without the adapter and resumes
    the run for a third step. Returns what the test checks."""
    (w_python, _), (r_python, _) = writer, reader
    base, run = os.path.join(root, "base"), os.path.join(root, "run")
    tokens = os.path.join(tiny, "tokens.json")
    _run(w_python, "convert", "hf-to-mcore", "--hf-dir", os.path.join(tiny, "hf"), "--save", base,
         "--no-progress")
    _train(w_python, tiny, base, run, iters=2)
    written = _logits(w_python, base, run, tokens, os.path.join(root, "written.safetensors"))
    read = _logits(r_python, base, run, tokens, os.path.join(root, "read.safetensors"))
    resumed = os.path.join(root, "resumed")
    shutil.copytree(run, resumed)
    proc = _train(r_python, tiny, base, resumed, iters=3)
    return dict(written=written, read=read, resumed=proc)


DIRECTIONS = ["other_to_ours", "ours_to_other"]


@pytest.fixture(scope="module")
def directions(environments, tiny, tmp_path_factory):
    """{direction: a future of `_direction`'s result}. The two directions are independent chains
    of one-process commands, so they run side by side (one core each on a 2-core machine)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(DIRECTIONS))
    futures = {}
    for direction in DIRECTIONS:
        writer, reader = ((environments["other"], environments["ours"])
                          if direction == "other_to_ours"
                          else (environments["ours"], environments["other"]))
        root = str(tmp_path_factory.mktemp(direction))
        futures[direction] = pool.submit(_direction, writer, reader, tiny, root)
    yield futures
    pool.shutdown(wait=True)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_checkpoints_load_across_releases(environments, directions, direction, tiny):
    tiny_dir = tiny
    writer, reader = ((environments["other"], environments["ours"]) if direction == "other_to_ours"
                      else (environments["ours"], environments["other"]))
    (_, w_release), (_, r_release) = writer, reader
    got = directions[direction].result(timeout=1700)  # re-raises a failed command's assertion
    written, read = got["written"], got["read"]
    assert written.shape == read.shape
    # Both are fp32 evaluations of the same adapted model, by the same code on two megatron-core
    # releases (their kernels may sum in other orders): each within K e of the exact logits,
    # e the fp32 rounding transformers measures on the base model in this process
    # (compare.reference_bound; 2 Adam steps of lr 5e-3 move the logits by far less than their
    # size, so the adapted model's rounding is of the same size), so within 2 (K + 1) e of each
    # other.
    from tests.export import _support as S

    tokens = torch.tensor(json.load(open(os.path.join(tiny_dir, "tokens.json"))))
    plain = S.in_both(S.hf_logits, os.path.join(tiny_dir, "hf"), tokens)
    bound = 2 * compare.reference_bound(*plain)
    compare.assert_within(read, written, bound,
                          f"logits of a {w_release} checkpoint under {r_release}")
    # The adapter changed the model: the comparison above is not of two base models (the base's
    # logits from transformers, in this process, rather than one more command per direction).
    S.assert_moved(read[..., :plain[0].shape[-1]], plain[0], bound, "the adapter")

    # The reading release resumes the run (optimizer state, scheduler, RNG) and trains on.
    proc = got["resumed"]
    assert re.search(r"iteration\s+3/\s*3\b", proc.stdout), proc.stdout[-2000:]
    assert not re.search(r"iteration\s+[12]/", proc.stdout), "the resumed run started over"
    assert torch.isfinite(read).all()
