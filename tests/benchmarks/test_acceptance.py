"""benchmarks/gpu/acceptance.py, the GPU acceptance run, end to end on CPU for two families: what
it prepares here is what it checks there, every part passes against the CPU losses and
transformers / PEFT, and a part that fails is a FAIL row while the rest still run."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _acceptance(*args):
    out = subprocess.run([sys.executable, "benchmarks/gpu/acceptance.py", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    return out, json.loads(out.stdout.strip().splitlines()[-1]) if args[0] == "run" else None


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("acceptance"))
    out, _ = _acceptance("prepare", directory, "--families", "mixtral", "qwen3_moe")
    assert out.returncode == 0, out.stderr[-3000:]
    return directory


def test_every_part_passes_on_cpu(prepared):
    out, result = _acceptance("run", prepared, "--families", "mixtral", "--device", "cpu")
    rows = {row["part"]: row for row in result["rows"]}
    # Mixtral has every run: LoRA (10 iterations) and DoRA, prefix, new tokens, NF4 (4 each).
    assert list(rows) == ["convert", "train lora", "train dora", "train prefix",
                          "train new_tokens", "train nf4", "logits", "peft", "generate"]
    assert result["failed"] == 0 and out.returncode == 0, [r for r in result["rows"]
                                                          if not r["ok"]]
    # What travels to the GPU: the tiny model, its data and the CPU losses, no checkpoints.
    assert {"cpu_losses.json", "data.jsonl", "hf"} <= set(os.listdir(
        os.path.join(prepared, "mixtral")))
    assert not os.path.exists(os.path.join(prepared, "mixtral", "cpu_runs"))
    with open(os.path.join(prepared, "acceptance.jsonl")) as f:
        assert [json.loads(line)["part"] for line in f] == list(rows)


def test_a_failing_part_does_not_stop_the_run(prepared):
    path = os.path.join(prepared, "qwen3_moe", "cpu_losses.json")
    with open(path) as f:
        reference = json.load(f)
    reference["lora"][-1] *= 1 + 3e-4  # beyond the relative 1e-4 the comparison allows
    with open(path, "w") as f:
        json.dump(reference, f)
    out, result = _acceptance("run", prepared, "--families", "qwen3_moe", "--device", "cpu")
    ok = {row["part"]: row["ok"] for row in result["rows"]}
    assert ok == {"convert": True, "train lora": False, "logits": True, "peft": True,
                  "generate": True}, result["rows"]
    assert out.returncode == 1 and result["failed"] == 1
    assert "FAIL" in out.stdout and "train lora" in out.stdout
