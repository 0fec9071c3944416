"""Bad inputs give a clear error naming the file, tensor or field, and leave no output directory
(not even a partial one) behind."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from megatron_lora.cli import main
from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.hf_to_mcore import hf_to_mcore
from megatron_lora.convert.mcore_to_hf import mcore_to_hf
from megatron_lora.families import ModelConfigError, read_hf_config
from megatron_lora.runtime import ParallelLayout


@pytest.fixture
def hf_copy(tiny_mixtral, tmp_path):
    path = str(tmp_path / "src")
    shutil.copytree(tiny_mixtral["hf"], path)
    return path


def shard_names(directory):
    return sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))


def edit_config(directory, **changes):
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)


def convert_fails(hf_dir, out, error=ConversionError):
    with pytest.raises(error) as info:
        hf_to_mcore(hf_dir, out, progress=False)
    parent = os.path.dirname(out)
    assert not os.path.exists(out)
    assert not [n for n in os.listdir(parent) if ".partial-" in n]
    return str(info.value)


def test_missing_shard_named_in_index(hf_copy, tmp_path):
    gone = shard_names(hf_copy)[3]
    os.remove(os.path.join(hf_copy, gone))
    msg = convert_fails(hf_copy, str(tmp_path / "out"))
    assert gone in msg and "missing" in msg


def test_truncated_safetensors_file(hf_copy, tmp_path):
    name = shard_names(hf_copy)[2]
    path = os.path.join(hf_copy, name)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    assert name in convert_fails(hf_copy, str(tmp_path / "out"))


def test_corrupt_safetensors_header(hf_copy, tmp_path):
    name = shard_names(hf_copy)[0]
    with open(os.path.join(hf_copy, name), "r+b") as f:
        f.seek(8)
        f.write(b"\x00garbage{")
    msg = convert_fails(hf_copy, str(tmp_path / "out"))
    assert name in msg and "safetensors" in msg


def test_tensor_shape_disagreeing_with_config(hf_copy, tmp_path):
    edit_config(hf_copy, intermediate_size=128)
    msg = convert_fails(hf_copy, str(tmp_path / "out"))
    assert "block_sparse_moe.experts.0.w1.weight" in msg and "intermediate_size=128" in msg


def test_non_mixtral_architecture(hf_copy, tmp_path):
    edit_config(hf_copy, architectures=["LlamaForCausalLM"], model_type="llama")
    msg = convert_fails(hf_copy, str(tmp_path / "out"), ModelConfigError)
    assert "config.json" in msg and "architectures" in msg and "LlamaForCausalLM" in msg


def test_failure_while_writing_leaves_no_output(hf_copy, tmp_path, monkeypatch):
    from megatron_lora.convert.hf_files import HFCheckpoint

    real_read, calls = HFCheckpoint.read, []

    def failing_read(self, name, index=None):
        calls.append(name)
        if len(calls) == 20:
            raise ConversionError(f"simulated read failure on {name}")
        return real_read(self, name, index)

    monkeypatch.setattr(HFCheckpoint, "read", failing_read)
    assert "simulated read failure" in convert_fails(hf_copy, str(tmp_path / "out"))


def test_existing_output_is_refused_and_kept(tiny_mixtral, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ConversionError, match="already exists"):
        hf_to_mcore(tiny_mixtral["hf"], str(out), progress=False)
    assert (out / "keep.txt").exists()


def test_corrupt_megatron_checkpoint_chunk(tiny_mixtral, tmp_path):
    bad = str(tmp_path / "mcore")
    shutil.copytree(tiny_mixtral["mcore"], bad)
    data = [n for n in os.listdir(bad) if n.endswith(".distcp")][0]
    with open(os.path.join(bad, data), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(bad, data)) // 2)
    out = str(tmp_path / "hf_out")
    with pytest.raises(ConversionError) as info:
        mcore_to_hf(bad, out, progress=False)
    assert data in str(info.value)
    assert not os.path.exists(out) and not [n for n in os.listdir(tmp_path) if ".partial-" in n]


@pytest.mark.parametrize("layout,world,needle", [
    (ParallelLayout(tp=3, sp=True), 3, "num_attention_heads=4"),
    (ParallelLayout(ep=3), 3, "num_experts=4"),
    (ParallelLayout(pp=3), 3, "num_layers=4"),
    (ParallelLayout(tp=2, sp=False), 2, "sequence parallelism"),
])
def test_layouts_that_do_not_divide_the_model(tiny_mixtral, layout, world, needle):
    info = read_hf_config(tiny_mixtral["hf"])
    problems = info.layout_problems(layout, world)
    assert any(needle in p for p in problems), problems


def test_cli_reports_errors_with_exit_code_2(hf_copy, tmp_path, capsys):
    os.remove(os.path.join(hf_copy, shard_names(hf_copy)[1]))
    out = str(tmp_path / "out")
    assert main(["convert", "hf-to-mcore", "--hf-dir", hf_copy, "--save", out, "--no-progress"]) == 2
    assert "error:" in capsys.readouterr().err and not os.path.exists(out)


def test_bad_layout_fails_on_every_rank_before_any_collective(tiny_mixtral, tmp_path):
    """3 ranks, TP3: the job fails fast with the layout error; nobody waits in a collective."""
    out = str(tmp_path / "logits.safetensors")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
           "--master-port", "29561", "-m", "megatron_lora", "logits",
           "--load", tiny_mixtral["mcore"], "--tokens", tiny_mixtral["tokens"], "--out", out,
           "--tensor-model-parallel-size", "3", "--sequence-parallel"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    # Each rank raises before any collective; torchrun stops the others once the first exits,
    # so not every rank always gets to print (the harness test of runtime.initialize checks
    # that every rank raises).
    message = "--tensor-model-parallel-size 3 does not divide num_attention_heads=4"
    assert proc.stderr.count(message) >= 1, proc.stderr[-3000:]
    assert not os.path.exists(out)


@pytest.mark.parametrize("change,field", [
    (dict(head_dim=32), "head_dim"),
    (dict(sliding_window=64), "sliding_window"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), "rope_type"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_local_experts=None), "num_local_experts"),
    (dict(num_experts_per_tok=5),
     r"field .num_experts_per_tok. must be <= num_experts \(4\), got 5"),
])
def test_config_fields_megatron_cannot_reproduce_are_named(tiny_mixtral, change, field):
    from megatron_lora.families import model_info

    with open(os.path.join(tiny_mixtral["hf"], "config.json")) as f:
        cfg = json.load(f)
    cfg.update(change)
    with pytest.raises(ModelConfigError, match=field):
        model_info(cfg)
