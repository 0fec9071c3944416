"""Commands under testing/device_check.py: what would fail on a GPU fails here.

One process runs train (LoRA with grouped and per-expert MLPs, DoRA with dropout and rsLoRA,
prefix tuning, new tokens, an NF4 base, validation, a resume, an --adapter start), generate
(greedy and sampled), logits, the exports and parity's reference under the check: no op mixes
host and device tensors, no collective gets a host tensor, no package factory lacks a device,
and the package reads device values on the host once a step (the gradient norm) and once per log
line, never per micro-batch or per trainable tensor. Train, generate and parity run so at two
ranks too. Then each of the four bugs the first GPU run met is put back
(tests/testing/_device_bugs.py) and must be caught.
"""

import collections
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import _make_tiny_example_module

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_example):
    out = tiny_example(tmp_path_factory.mktemp("device_check"), samples=48, mcore=True)
    maker = _make_tiny_example_module()
    maker.make_tokenizer(os.path.join(out, "hf"), [maker.TOKENIZER_TEXT], vocab_size=384)
    with open(os.path.join(out, "prompts.jsonl"), "w") as f:
        f.write(json.dumps({"prompt": "The capital of France is"}) + "\n")
    with open(os.path.join(out, "tokens.json"), "w") as f:
        json.dump([[1, 2, 3, 4, 5, 6]], f)
    return out


def _train(tiny, save, *extra, iters=2, micro=1, hf=True):
    model = ["--load-hf", "hf"] if hf else ["--load", "mcore"]
    return ["train", *model, "--data-path", "data.jsonl", "--tokenizer", "byte",
            "--seq-length", "32", "--micro-batch-size", str(micro), "--global-batch-size", "4",
            "--train-iters", str(iters), "--log-interval", "2", "--lr", "1e-3",
            "--save", save, *extra]


LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1", "--lora-use-rslora",
        "--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def _run(tiny, commands, setup=None, timeout=TIMEOUT_S):
    """Start the driver over `commands` in tiny's folder; returns (Popen, report path)."""
    report = os.path.join(tiny, f"report-{setup or 'clean'}.json")
    argv = [sys.executable, "-m", "megatron_lora.cli.device_check", report]
    if setup:
        argv += ["--setup", f"tests.testing._device_bugs:{setup}"]
    argv.append("--")
    for k, command in enumerate(commands):
        argv += (["--then"] if k else []) + command
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(argv, cwd=tiny, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, report


def _finish(proc, report, timeout=TIMEOUT_S):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the checked commands did not finish in {timeout} s:\n{out[-4000:]}")
    assert os.path.exists(report), out[-4000:]
    with open(report) as f:
        return json.load(f), out


@pytest.fixture(scope="module")
def clean_run(tiny):
    commands = [
        _train(tiny, "runs/grouped", *LORA, "--moe-grouped-gemm", "--eval-interval", "2",
               "--eval-fraction", "0.1", iters=4),
        _train(tiny, "runs/grouped", *LORA, "--moe-grouped-gemm", iters=6),  # a resume
        _train(tiny, "runs/seq", *LORA, "--no-moe-grouped-gemm", iters=4, micro=2),
        _train(tiny, "runs/seq4", *LORA, "--no-moe-grouped-gemm", iters=4, micro=1),
        _train(tiny, "runs/dora", *LORA, "--lora-use-dora"),
        _train(tiny, "runs/prefix", "--peft-type", "prefix", "--num-virtual-tokens", "4",
               hf=False),
        _train(tiny, "runs/tokens", "--lora-rank", "4", "--add-special-tokens", "<|im_start|>"),
        _train(tiny, "runs/nf4", "--lora-rank", "4", "--base-quantization", "nf4"),
        _train(tiny, "runs/start", "--adapter", "runs/grouped"),
        ["generate", "--load-hf", "hf", "--adapter", "runs/grouped", "--tokenizer", "hf",
         "--prompts", "prompts.jsonl", "--out", "greedy.jsonl", "--max-new-tokens", "3"],
        ["generate", "--load-hf", "hf", "--adapter", "runs/prefix", "--tokenizer", "hf",
         "--prompts", "prompts.jsonl", "--out", "sampled.jsonl", "--max-new-tokens", "3",
         "--temperature", "0.7"],
        ["logits", "--load", "mcore", "--adapter", "runs/dora", "--tokens", "tokens.json",
         "--out", "logits.safetensors"],
        ["export", "peft", "--adapter", "runs/grouped", "--load-hf", "hf", "--save", "peft"],
        ["export", "hf", "--load", "mcore", "--adapter", "runs/dora", "--merge",
         "--save", "merged", "--no-progress"],
        ["parity", "reference", "--dir", "parity"],
    ]
    # new tokens need a tokenizer with room for them: the tiny model's own
    tokens = commands[6]
    tokens[tokens.index("byte")] = "hf"
    proc, report = _run(tiny, commands)
    result, out = _finish(proc, report)
    return commands, result, out


def test_every_command_runs_as_on_a_gpu(clean_run):
    commands, result, out = clean_run
    assert result["errors"] == [], out[-4000:]
    failed = [" ".join(c[:2]) for c, code in zip(commands, result["exit_codes"]) if code]
    assert not failed, f"commands that failed: {failed}\n{out[-4000:]}"
    assert result["steps"] == 4 + 2 + 4 + 4 + 2 + 2 + 2 + 2 + 2
    # What the run computes with, said once per process (models/describe.py).
    banner = [line for line in out.splitlines() if line.startswith("megatron-lora: cpu")]
    assert len(banner) == 1 and "gloo" in banner[0] and "experts: " in banner[0], banner


def _package_reads(result, command):
    """{step: the package's host reads in it} of one command (steps numbered over the whole
    run; reads while the command sets up are left out)."""
    return collections.Counter(r["step"] for r in result["reads"]
                               if r["command"] == command and "/megatron_lora/" in r["site"]
                               and not r["setup"])


def test_the_package_reads_the_device_once_per_log_line(clean_run):
    commands, result, out = clean_run
    training = {r["site"].split(" in ")[1] for r in result["reads"]
                if "/megatron_lora/" in r["site"] and not r["setup"]
                and commands[r["command"]][0] == "train"}
    # What training may read once it steps: the gradient norm once a step (grad_norm.py's step),
    # the pending losses at a log line (loop's read), a validation's mean, the checkpoint's
    # agreement flag (once per save).
    assert training <= {"step", "read", "evaluate", "_agree"}, training
    # The per-expert runs: 4 iterations at --log-interval 2, with 2 and 4 micro-batches a step,
    # read the same: the norm once a step, and once more at each log line.
    for command in (2, 3):
        reads = _package_reads(result, command)
        first = min(r["step"] for r in result["reads"] if r["command"] == command
                    and not r["setup"])
        assert [reads.get(first + k, 0) for k in range(4)] == [1, 2, 1, 2], (command, reads)


@pytest.mark.parametrize("bug, expected", [
    ("host_count_all_reduce", "torch.distributed.all_reduce of host tensors"),
    ("host_loss_pair", "mixes host tensors [(2,)]"),
    ("batch_left_on_host", "embedding mixes host tensors"),
    ("prefix_on_host", "parameters not on this rank's device"),
])
def test_each_first_gpu_bug_is_caught(tiny, bug, expected):
    if bug == "prefix_on_host":
        command = _train(tiny, f"runs/{bug}", "--peft-type", "prefix", "--num-virtual-tokens",
                         "4", iters=1)
    else:
        command = _train(tiny, f"runs/{bug}", "--lora-rank", "4", iters=1)
    proc, report = _run(tiny, [command], setup=bug)
    result, out = _finish(proc, report)
    assert result["exit_codes"] != [0], out[-3000:]
    seen = result["errors"] + [out]
    assert any(expected in text for text in seen), (expected, result["errors"], out[-3000:])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(tiny, command, report, ranks=2):
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
            "--master-port", str(_free_port()), "-m",
            "megatron_lora.cli.device_check", report, "--", *command]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(argv, cwd=tiny, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    seen = []
    for rank in range(ranks):
        with open(f"{report}.rank{rank}") as f:
            seen.append(json.load(f))
    return out, seen


def test_several_ranks_run_as_on_gpus(tiny, clean_run):
    """Two ranks, each checked: training at TP2 with sequence parallelism and EP2 with the
    all-to-all dispatcher (the LoRA path's TP collectives, megatron's token all-to-all), then
    generate with that adapter at PP2 (pipeline sends, the chosen token's broadcast), then the
    parity check of the one-rank reference (clean_run's) at TP2+SP and PP2."""
    train = _train(tiny, "runs/ranks", *LORA, "--tensor-model-parallel-size", "2",
                   "--sequence-parallel", "--expert-model-parallel-size", "2",
                   "--expert-tensor-parallel-size", "1", "--moe-token-dispatcher-type",
                   "alltoall")
    generate = ["generate", "--load-hf", "hf", "--adapter", "runs/ranks", "--tokenizer", "hf",
                "--prompts", "prompts.jsonl", "--out", "ranks.jsonl", "--max-new-tokens", "3",
                "--pipeline-model-parallel-size", "2"]
    parity = ["parity", "check", "--dir", "parity", "--layouts", "TP2+SP", "PP2"]
    for name, command in (("train", train), ("generate", generate), ("parity", parity)):
        out, seen = _torchrun(tiny, command, os.path.join(tiny, f"ranks-{name}.json"))
        assert out.returncode == 0, out.stderr[-3000:]
        for rank, report in enumerate(seen):
            assert report["errors"] == [] and report["exit_codes"] == [0], (name, rank, report)


def test_each_device_scalar_given_to_torch_tensor_in_a_list_is_a_host_read():
    # megatron-core's gradient-norm fallback makes torch.tensor([norm of each gradient]): on a GPU
    # one copy to the host (a synchronisation) per element.
    import torch

    from megatron_lora.testing.device_check import RANK, DeviceCheck

    with DeviceCheck() as check:
        x = torch.arange(6.0, device=RANK)
        norms = [torch.norm(t) for t in x.split(2)]
        torch.tensor([norms[:2], norms[1:]])  # nested lists: each element read
        torch.tensor(x)  # a tensor, not a list: copied, not read element by element
        torch.tensor([1.0, 2.0])  # host numbers: nothing read
    assert [r.what for r in check.reads] == ["tensor"] * 4, check.reads
