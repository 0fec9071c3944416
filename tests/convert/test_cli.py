"""The commands as users run them: convert both ways, then `logits` under torchrun."""

import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from megatron_lora.cli import main


def test_convert_commands_then_logits_under_torchrun(tiny_mixtral, tmp_path):
    mcore, hf_out = str(tmp_path / "mcore"), str(tmp_path / "hf_out")
    assert main(["convert", "hf-to-mcore", "--hf-dir", tiny_mixtral["hf"], "--save", mcore,
                 "--no-progress"]) == 0
    assert main(["convert", "mcore-to-hf", "--load", mcore, "--save", hf_out,
                 "--max-shard-size", "300KB", "--no-progress"]) == 0
    assert len([n for n in os.listdir(hf_out) if n.endswith(".safetensors")]) > 1

    out = str(tmp_path / "logits.safetensors")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", "29562", "-m", "megatron_lora", "logits", "--load", mcore,
           "--tokens", tiny_mixtral["tokens"], "--out", out,
           "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = load_file(out)
    assert list(got) == ["logits"] and got["logits"].dtype == torch.float32
    ref = load_file(tiny_mixtral["reference"])["logits"]
    assert got["logits"].shape == ref.shape
    assert (got["logits"] - ref).abs().max().item() <= 1e-4
