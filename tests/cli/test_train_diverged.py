"""`train` stops at a NaN or infinite loss or gradient norm, naming the iteration (Megatron-LM
exits on a NaN loss), instead of logging `lm loss: NAN` to the end and saving it."""

import os
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_example):
    return tiny_example(tmp_path_factory.mktemp("diverged"), samples=32)


@pytest.mark.parametrize("clip", ["1.0", "0"])
def test_a_diverging_run_stops_at_its_iteration(tiny, tmp_path, clip):
    # lr 1e30: the first Adam step (about lr per element) makes every later value non-finite.
    # megatron's optimizer reports the gradient norm with or without clipping, read each
    # iteration: iteration 2 is named, not the log line's (--log-interval 3). The loss's own
    # check is tests/training/test_loop.py's.
    what = "gradient norm"
    save = str(tmp_path / "run")
    out = subprocess.run(
        [sys.executable, "-m", "megatron_lora", "train", "--load-hf", os.path.join(tiny, "hf"),
         "--data-path", os.path.join(tiny, "data.jsonl"), "--tokenizer", "byte",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "6", "--lora-rank", "4", "--lr", "1e30", "--clip-grad", clip,
         "--log-interval", "3", "--save-interval", "1", "--save", save],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert out.returncode == 1, out.stderr[-2000:]
    error = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(error) == 1 and f"iteration 2: the {what} is" in error[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    # iteration 1 was finite and saved; nothing after it
    saved = sorted(d for d in os.listdir(save) if d.startswith("iter_"))
    assert saved == ["iter_0000001"], saved
    assert "the last checkpoint is" in error[0]
