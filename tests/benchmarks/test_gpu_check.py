"""benchmarks/gpu/check.py, the one-shot GPU check, runs end to end on CPU with tiny shapes
(`--tiny`): every mode trains through megatron-lora's own stack and the JSON line holds every
field the GPU run reports, with values that agree with each other."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gpu_check_smoke_on_cpu():
    from benchmarks.gpu.check import SHAPE_8X7B, flops_per_token

    out = subprocess.run([sys.executable, "benchmarks/gpu/check.py", "--tiny", "--steps", "1"],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    modes = result["modes"]
    assert set(modes) == {"frozen", "lora", "full", "dora", "prefix", "lora_sequential",
                          "frozen_sequential"}
    for name, mode in modes.items():
        assert mode["ms_per_step"] > 0 and mode["tokens_per_s"] > 0, name
        assert mode["model_tflops"] >= 0 and 0 <= mode["mfu"] < 1, name
    trainable = {name: mode["trainable_parameters"] for name, mode in modes.items()}
    # frozen trains only the final norm; LoRA some; full everything.
    assert trainable["frozen"] == result["shape"]["hidden_size"]
    assert trainable["frozen"] < trainable["lora"] < trainable["full"]
    assert trainable["lora"] == trainable["lora_sequential"]
    assert trainable["frozen"] < trainable["prefix"] < trainable["full"]
    assert trainable["lora"] < trainable["dora"] < trainable["full"]  # + the magnitudes
    ms = {name: mode["ms_per_step"] for name, mode in modes.items()}
    assert result["dora_over_lora"] == pytest.approx(ms["dora"] / ms["lora"], rel=1e-3)
    assert result["prefix_over_lora"] == pytest.approx(ms["prefix"] / ms["lora"], rel=1e-3)
    assert result["lora_over_frozen"] == pytest.approx(ms["lora"] / ms["frozen"], rel=1e-3)
    assert result["lora_over_full"] == pytest.approx(ms["lora"] / ms["full"], rel=1e-3)
    assert result["grouped_over_sequential_lora"] == pytest.approx(
        ms["lora"] / ms["lora_sequential"], rel=1e-3)
    # The stated formula at 8x7B shapes: N = 2 layers x (42 M attention + 352 M top-2
    # experts) + 131 M output layer; full = 6 N + 3 x 4 L s h / 2.
    n = 2 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 2 * 3 * 4096 * 14336) + 32000 * 4096
    attention = 3 * 4 * 2 * 4096 * 4096 / 2
    assert flops_per_token(SHAPE_8X7B, 4096, "full") == 6 * n + attention
    assert flops_per_token(SHAPE_8X7B, 4096, "lora") == 4 * n + attention
