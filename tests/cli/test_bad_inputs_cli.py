"""`logits` and `train` with inputs that do not fit: exit 2 with one message naming the flag, file
and field, before the model is built and before any collective, on every rank."""

import json
import os
import subprocess
import sys

import pytest

from tests.convert.tiny import make_tiny_mixtral, make_tokens, write_tokens

PORT = 29700 + os.getpid() % 200


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny HF Mixtral (4 experts, vocabulary 384 so the byte tokenizer fits), its torch_dist
    conversion, token ids and a small JSONL dataset."""
    from megatron_lora.convert.hf_to_mcore import hf_to_mcore

    root = tmp_path_factory.mktemp("bad_inputs_cli")
    paths = {k: str(root / k) for k in ("hf", "mcore")}
    make_tiny_mixtral(paths["hf"], vocab_size=384)
    hf_to_mcore(paths["hf"], paths["mcore"], progress=False)
    paths["tokens"] = str(root / "tokens.json")
    write_tokens(paths["tokens"], make_tokens(batch=2, seq=8, vocab=384))
    paths["data"] = str(root / "data.jsonl")
    with open(paths["data"], "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"q{i}?", "response": f" a{i}."}) + "\n")
    return paths


def _env():
    return dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")


@pytest.fixture
def single_rank_env(monkeypatch):
    """The environment of a plain one-process run, restored after the test (`train` sets the
    torchrun variables it finds missing)."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", str(PORT + 10))):
        monkeypatch.setenv(k, v)


def _config(tiny, tmp_path, **changes):
    with open(os.path.join(tiny["hf"], "config.json")) as f:
        cfg = json.load(f)
    cfg.update(changes)
    path = str(tmp_path / "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return path


def _args(command, tiny, tmp_path, *extra):
    if command == "logits":
        return ["logits", "--tokens", tiny["tokens"], "--out", str(tmp_path / "out.safetensors"),
                *extra]
    return ["train", "--data-path", tiny["data"], "--tokenizer", "byte", "--seq-length", "16",
            "--global-batch-size", "2", "--train-iters", "1", "--lora-rank", "2",
            "--save", str(tmp_path / "run"), *extra]


def _outputs_absent(tmp_path):
    return not (tmp_path / "out.safetensors").exists() and not (tmp_path / "run").exists()


HIDDEN = ["hidden_size=128 disagrees with it (embedding.word_embeddings.weight is [384, 128] by "
          "the config, [384, 64] in the checkpoint"]
# Would be 2 x 10^11 x 64 fp32 (over 40 TiB) to allocate: refused with the size.
HUGE = ["vocab_size=100000000000 (padded", "GiB per rank in float32 at TP1, more than this "
        "machine's"]


@pytest.mark.parametrize("command,change,needles", [
    ("logits", dict(hidden_size=128), HIDDEN),
    ("train", dict(hidden_size=128), HIDDEN),
    ("logits", dict(vocab_size=10 ** 11), HUGE),
    ("train", dict(vocab_size=1e9), ["field 'vocab_size' must be a positive integer, got "
                                     "1000000000.0"]),
])
def test_hf_config_that_does_not_fit_the_checkpoint(tiny, tmp_path, capsys, single_rank_env,
                                                    command, change, needles):
    """Run in this process (`main` is what `python -m megatron_lora` calls): the refusal comes
    before any collective, so no process group is made; the multi-rank cases below use real
    processes."""
    from megatron_lora.cli import main

    config = _config(tiny, tmp_path, **change)
    code = main(_args(command, tiny, tmp_path, "--load", tiny["mcore"], "--hf-config", config))
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    assert "Traceback" not in err and "CheckpointException" not in err
    assert f"megatron-lora {command}: error: " in err
    assert config in err, err  # the file at fault, named once
    assert err.count(config) == 1, err
    if "hidden_size" in change or "vocab_size" in change and change["vocab_size"] == 10 ** 11:
        assert f"--hf-config {config} does not describe the checkpoint {tiny['mcore']}: " in err
    for needle in needles:
        assert needle in err, err[-3000:]
    assert _outputs_absent(tmp_path)


ROUTER_RANK = ("LoRA rank 8 (--lora-rank) exceeds min(in_features, out_features) = 4 of router "
               "(in_features 64 = hidden size, out_features 4 = number of experts); use a rank "
               "<= 4 (for router alone: --lora-rank-pattern router=R) or drop router from "
               "--lora-target-modules")


def _router_cmd(tiny, tmp_path, *extra):
    args = _args("train", tiny, tmp_path, "--load-hf", tiny["hf"], "--lora-target-modules",
                 "linear_qkv", "router", "--lora-rank", "8", *extra)
    return [sys.executable, "-m", "megatron_lora", *args]


def test_router_rank_too_large_fails_alone_on_each_rank_of_two(tiny, tmp_path):
    """Rank 0 and rank 1 of a 2-rank job each run alone (each told a different rendezvous port,
    so they can never meet): both exit 2 with the message. Had either reached a collective
    (init_process_group included) it would wait for the absent other rank until the timeout, so
    this shows the check runs on every rank before any collective."""
    procs = []
    try:
        for rank in (0, 1):
            env = dict(_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                       LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(PORT + 2 + rank))
            procs.append(subprocess.Popen(_router_cmd(tiny, tmp_path), env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        for proc in procs:
            _, err = proc.communicate(timeout=240)
            assert proc.returncode == 2, err[-3000:]
            assert err.strip() == f"megatron-lora train: error: {ROUTER_RANK}", err[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert _outputs_absent(tmp_path)


def test_router_rank_too_large_under_torchrun(tiny, tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port",
           str(PORT + 1), *_router_cmd(tiny, tmp_path)[1:]]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode != 0
    assert f"megatron-lora train: error: {ROUTER_RANK}" in out.stderr, out.stderr[-3000:]
    assert "exitcode  : 2" in out.stderr  # the first rank to finish exited 2; torchrun then
    # stops the other (the lone-rank test above shows each rank exits 2 by itself), and prints
    # its own ChildFailedError traceback: the only one.
    assert out.stderr.count("Traceback") == 1 and "ChildFailedError" in out.stderr
    assert "LoraConfig.r" not in out.stderr
    assert _outputs_absent(tmp_path)


def test_router_gets_its_own_rank_with_lora_rank_pattern(tiny, tmp_path):
    """--lora-rank-pattern router=4 with --lora-rank 8: one step trains; the checkpoint records
    the router's rank."""
    cmd = _router_cmd(tiny, tmp_path, "--lora-rank-pattern", "router=4")
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    from megatron_lora.export.adapter_ckpt import AdapterCheckpoint
    from megatron_lora.families import read_hf_config

    ckpt = AdapterCheckpoint(str(tmp_path / "run"), read_hf_config(tiny["hf"]))
    assert ckpt.config.rank_pattern == {"router": 4} and ckpt.config.r == 8
    assert ckpt.ranks == {"linear_qkv": 8, "router": 4}


@pytest.mark.parametrize("value", ["router", "router=0", "router=x", "(=2"])
def test_bad_lora_rank_pattern_is_a_usage_error(value, capsys):
    from megatron_lora.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["train", "--load-hf", "x", "--data-path", "d", "--tokenizer",
                                   "byte", "--seq-length", "8", "--global-batch-size", "1",
                                   "--train-iters", "1", "--lora-rank-pattern", value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --lora-rank-pattern" in err and value in err, err
    assert build_parser().parse_args([
        "train", "--load-hf", "x", "--data-path", "d", "--tokenizer", "byte", "--seq-length", "8",
        "--global-batch-size", "1", "--train-iters", "1", "--lora-rank-pattern", "router=4",
        r"layers\.0\.=2"]).lora_rank_pattern == [("router", 4), (r"layers\.0\.", 2)]


@pytest.mark.parametrize("flags,needle", [
    (["--lora-rank", "0"], "--lora-rank must be a positive integer, got 0"),
    (["--lora-alpha", "-1"], "--lora-alpha must be a finite number > 0, got -1"),
    (["--lora-dropout", "1.5"], "--lora-dropout must be in [0, 1), got 1.5"),
    # the optimizer's settings, by their flags too (not OptimConfig's field names)
    (["--lr-warmup-iters", "99"], "--lr-warmup-iters must be in [0, --train-iters "),
    (["--min-lr", "5"], "--min-lr must be in [0, --lr "),
    (["--clip-grad", "-1"], "--clip-grad and --weight-decay must be >= 0, got -1.0"),
])
def test_bad_lora_values_name_the_flag(tiny, tmp_path, flags, needle):
    from megatron_lora.cli import build_parser
    from megatron_lora.runtime import ParallelLayout
    from megatron_lora.cli.train_run import TrainSetupError, _setup_checks

    args = build_parser().parse_args(_args("train", tiny, tmp_path, "--load", tiny["mcore"],
                                           "--hf-config", tiny["hf"], *flags))
    with pytest.raises(TrainSetupError) as err:
        _setup_checks(args, ParallelLayout(), 1)
    assert needle in str(err.value) and "LoraConfig" not in str(err.value), str(err.value)
    assert _outputs_absent(tmp_path)
