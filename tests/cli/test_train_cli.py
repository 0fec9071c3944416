"""`megatron-lora train` as a user runs it: under torchrun, killed and resumed, and with bad input."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_example):
    return tiny_example(tmp_path_factory.mktemp("tiny"), samples=96)


def _cmd(tiny, save, iters, *extra, ranks=2):
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                "--master-port", str(29600 + (os.getpid() % 200)), "-m", "megatron_lora"]
    if ranks == 1:
        launcher = [sys.executable, "-m", "megatron_lora"]
    return launcher + [
        "train", "--load-hf", os.path.join(tiny, "hf"), "--data-path",
        os.path.join(tiny, "data.jsonl"), "--tokenizer", "byte", "--seq-length", "32",
        "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", str(iters),
        "--lr", "5e-3", "--lora-rank", "4", "--lora-alpha", "8", "--save", save,
        "--log-interval", "1", "--seed", "3",
        "--lora-target-modules", "linear_qkv", "linear_proj", *extra]


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")


@pytest.fixture
def single_rank_env(monkeypatch):
    """The environment of a plain one-process run, restored after the test (`train` sets the
    torchrun variables it finds missing)."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", str(29600 + (os.getpid() % 200) + 1))):
        monkeypatch.setenv(k, v)


def _in_process(cmd, capsys):
    """(exit status, stderr) of a one-process command `python -m megatron_lora ARGS` run through
    `main` in this process (what that module calls). Only for runs refused before any collective:
    they make no process group, so nothing stays behind here."""
    from megatron_lora.cli import main

    assert cmd[:3] == [sys.executable, "-m", "megatron_lora"], cmd
    code = main(cmd[3:])
    return code, capsys.readouterr().err


def _losses(text):
    return {int(i): l for i, l in re.findall(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)", text)}


# LoRA dropout draws random numbers at every step, so the resumed job matches only if the
# checkpoint restored every rank's RNG state.
DROPOUT_EP2 = ("--expert-model-parallel-size", "2", "--lora-dropout", "0.1")


# The uninterrupted run recomputes activations and the killed and resumed one does not: the
# losses must still be bit-identical (recomputation restores the RNG states, so the recomputed
# forward redraws the same dropout keys).
RECOMPUTE = ("--recompute-granularity", "full", "--recompute-method", "block",
             "--recompute-num-layers", "1")


def test_killed_run_resumes_with_bit_identical_losses(tiny, tmp_path):
    straight = subprocess.run(_cmd(tiny, str(tmp_path / "a"), 6, *DROPOUT_EP2, *RECOMPUTE),
                              capture_output=True, text=True, env=_env(), timeout=300)
    assert straight.returncode == 0, straight.stderr[-3000:]
    expected = _losses(straight.stdout)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    save = str(tmp_path / "b")
    proc = subprocess.Popen(_cmd(tiny, save, 6, *DROPOUT_EP2,
                                 "--save-interval", "3"),
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=_env(), start_new_session=True)
    tracker = os.path.join(save, "latest_checkpointed_iteration.txt")
    deadline = time.monotonic() + 240
    while not os.path.exists(tracker) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    # The whole job at once, like a preempted node: torchrun and every worker it started.
    job = psutil.Process(proc.pid)
    members = job.children(recursive=True)
    for p in members + [job]:
        p.send_signal(signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(members, timeout=10)
    assert open(tracker).read().strip() == "3"

    resumed = subprocess.run(_cmd(tiny, save, 6, *DROPOUT_EP2,
                                  "--save-interval", "3"),
                             capture_output=True, text=True, env=_env(), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    got = _losses(resumed.stdout)
    assert sorted(got) == [4, 5, 6], resumed.stdout[-3000:]
    assert [got[i] for i in (4, 5, 6)] == [expected[i] for i in (4, 5, 6)]


@pytest.mark.parametrize("change,message", [
    ("malformed", "data.jsonl:3: not valid JSON"),
    ("batch", "global_batch_size=6 is not a multiple of micro_batch_size=4"),
    ("layout", "--expert-model-parallel-size 3 does not divide num_experts=4"),
    ("target", "unknown LoRA target 'qproj'"),
    ("recompute", "--recompute-method applies to --recompute-granularity full only"),
    ("grouped_te", "--moe-grouped-gemm builds grouped experts from the local layers"),
])
def test_bad_input_is_a_clear_error_before_training(tiny, tmp_path, capsys, single_rank_env,
                                                   change, message):
    args = []
    data = os.path.join(tiny, "data.jsonl")
    if change == "malformed":
        lines = open(data).read().splitlines()
        lines[2] = lines[2][:-3]
        data = str(tmp_path / "data.jsonl")
        open(data, "w").write("\n".join(lines) + "\n")
    elif change == "batch":
        args = ["--global-batch-size", "6", "--micro-batch-size", "4"]
    elif change == "layout":
        args = ["--expert-model-parallel-size", "3"]
    elif change == "target":
        args = ["--lora-target-modules", "qproj"]  # the later flag wins
    elif change == "recompute":
        args = ["--recompute-granularity", "selective", "--recompute-method", "uniform"]
    elif change == "grouped_te":
        args = ["--moe-grouped-gemm", "--transformer-impl", "transformer_engine"]
    cmd = _cmd(tiny, str(tmp_path / "run"), 2, *args, ranks=1)
    cmd[cmd.index("--data-path") + 1] = data
    code, err = _in_process(cmd, capsys)
    assert code == 2, err[-2000:]
    assert message in err
    assert "Traceback" not in err
    assert not os.path.exists(tmp_path / "run")  # nothing written


def test_a_tracker_naming_a_missing_iteration_is_a_clear_error(tiny, tmp_path, capsys,
                                                               single_rank_env):
    save = tmp_path / "run"
    (save / "iter_0000003").mkdir(parents=True)
    tracker = save / "latest_checkpointed_iteration.txt"
    tracker.write_text("6\n")  # iter_0000006 was deleted, or the folder copied without it
    code, err = _in_process(_cmd(tiny, str(save), 2, ranks=1), capsys)
    assert code == 2, err[-2000:]
    assert "Traceback" not in err
    assert f"{tracker} names iteration 6 but {save / 'iter_0000006'} does not exist" in err
    assert "or write one of the complete iterations here, [3], into it" in err  # what to do
    assert tracker.read_text() == "6\n" and sorted(os.listdir(save)) == [
        "iter_0000003", "latest_checkpointed_iteration.txt"]  # nothing touched


def _prefix_cmd(tiny, save, *extra):
    """A one-process prefix-tuning command line without the --lora-* flags of _cmd."""
    cmd = _cmd(tiny, save, 2, ranks=1)
    cut = cmd.index("--lora-rank")
    cmd = cmd[:cut] + cmd[cut + 4:]  # --lora-rank 4 --lora-alpha 8
    cmd = cmd[:cmd.index("--lora-target-modules")]
    return cmd + ["--peft-type", "prefix", *extra]


@pytest.mark.parametrize("extra,lora,message", [
    (["--num-virtual-tokens", "4"], True,
     "--peft-type prefix trains key/value prefixes only; --lora-rank, --lora-alpha, "
     "--lora-target-modules cannot be combined with it: PEFT loads one adapter type per adapter"),
    ([], False, "--peft-type prefix needs --num-virtual-tokens N >= 1"),
    (["--num-virtual-tokens", "0"], False, "--peft-type prefix needs --num-virtual-tokens N >= 1 "
     "(the prefix length, e.g. 20), got 0"),
    (["--num-virtual-tokens", "4", "--prefix-encoder-hidden-size", "8"], False,
     "--prefix-encoder-hidden-size needs --prefix-projection"),
    (["--num-virtual-tokens", "4", "--add-special-tokens", "<x>"], False,
     "--add-special-tokens cannot be combined with it"),
])
def test_prefix_flags_are_checked_before_training(tiny, tmp_path, capsys, single_rank_env,
                                                  extra, lora, message):
    save = str(tmp_path / "run")
    if lora:  # the LoRA flags of _cmd stay
        cmd = _cmd(tiny, save, 2, "--peft-type", "prefix", *extra, ranks=1)
    else:
        cmd = _prefix_cmd(tiny, save, *extra)
    code, err = _in_process(cmd, capsys)
    assert code == 2, err[-2000:]
    assert message in err, err[-2000:]
    assert "Traceback" not in err
    assert not os.path.exists(save)


def test_prefix_flags_without_the_prefix_type_are_refused(tiny, tmp_path, capsys,
                                                          single_rank_env):
    cmd = _cmd(tiny, str(tmp_path / "run"), 2, "--num-virtual-tokens", "4",
               "--prefix-projection", ranks=1)
    code, err = _in_process(cmd, capsys)
    assert code == 2, err[-2000:]
    assert ("--num-virtual-tokens, --prefix-projection: prefix-tuning flags, used only with "
            "--peft-type prefix") in err
    assert not os.path.exists(tmp_path / "run")
