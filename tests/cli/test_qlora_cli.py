"""`--base-quantization nf4` through the commands: widths that would split a block of 64 are
refused before anything starts (exit 2, one line naming the field or flag and the width); a
QLoRA run (train on the NF4 base, export peft) gives an ordinary PEFT adapter which, loaded by
PEFT onto the checkpoint copy whose projections are bitsandbytes' round trip, matches
`logits --adapter --base-quantization nf4` within 1e-4 (fp32); export says the adapter was
trained on an NF4 base; generate runs on the NF4 base with the adapter."""

import glob
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.convert.tiny import make_tiny_mixtral, make_tokens, write_tokens
from tests.export import _support as S

bnbf = pytest.importorskip("bitsandbytes.functional")
PORT = 29600 + os.getpid() % 100
QUANTISED = ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora_cli")
    paths = {k: str(root / k) for k in ("narrow", "wide", "wide_nf4")}
    make_tiny_mixtral(paths["narrow"], vocab_size=384)  # hidden 64, expert ffn 96
    make_tiny_mixtral(paths["wide"], vocab_size=384, hidden_size=128, intermediate_size=128,
                      num_hidden_layers=2)
    shutil.copytree(paths["wide"], paths["wide_nf4"])
    for f in glob.glob(os.path.join(paths["wide_nf4"], "*.safetensors")):
        tensors = load_file(f)
        for name, t in tensors.items():
            if ".layers." in name and name.endswith(QUANTISED):
                q, state = bnbf.quantize_4bit(t.contiguous(), blocksize=64, quant_type="nf4",
                                              compress_statistics=True)
                tensors[name] = bnbf.dequantize_4bit(q, state)
        save_file(tensors, f, metadata={"format": "pt"})
    paths["tokens"] = str(root / "tokens.json")
    write_tokens(paths["tokens"], make_tokens(batch=2, seq=8, vocab=384))
    paths["data"] = str(root / "data.jsonl")
    with open(paths["data"], "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"q{i}?", "response": f" a{i}."}) + "\n")
    return paths


@pytest.fixture
def env(monkeypatch):
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", str(PORT))):
        monkeypatch.setenv(k, v)
    return monkeypatch


def test_widths_that_split_blocks_are_refused_naming_the_flag(models, tmp_path, capsys, env):
    """In this process: the refusal comes before any collective (no process group is made)."""
    from megatron_lora.cli import main

    out = str(tmp_path / "out.safetensors")
    code = main(["logits", "--load-hf", models["narrow"], "--tokens", models["tokens"], "--out",
                 out, "--base-quantization", "nf4"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert ("megatron-lora logits: error: --base-quantization nf4: moe_ffn_hidden_size (input "
            "of each expert's fc2) = 96 is not a multiple of 64") in err, err
    env.setenv("WORLD_SIZE", "4")  # checked against 4 ranks; nothing starts
    code = main(["train", "--load-hf", models["wide"], "--data-path", models["data"],
                 "--tokenizer", "byte", "--seq-length", "16", "--global-batch-size", "2",
                 "--train-iters", "1", "--save", str(tmp_path / "run"),
                 "--expert-tensor-parallel-size", "4", "--base-quantization", "nf4"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert ("moe_ffn_hidden_size (input of each expert's fc2) = 128 split over "
            "--expert-tensor-parallel-size 4 gives 32 input columns per rank, not a multiple of "
            "64 (NF4 blocks are 64 input columns of one row); use a smaller "
            "--expert-tensor-parallel-size") in err, err
    assert not os.path.exists(out) and not (tmp_path / "run").exists()


def test_qlora_adapter_exports_to_peft_on_the_round_trip(models, tmp_path):
    run, peft, out = (str(tmp_path / n) for n in ("run", "peft", "logits.safetensors"))
    done = S.cli("train", "--load-hf", models["wide"], "--data-path", models["data"],
                 "--tokenizer", "byte", "--seq-length", "16", "--global-batch-size", "2",
                 "--train-iters", "3", "--lr", "1e-2", "--lora-rank", "4",
                 "--lora-target-modules", "linear_qkv", "linear_proj", "linear_fc1",
                 "linear_fc2", "--save", run, "--base-quantization", "nf4", port=PORT + 1)
    assert done.returncode == 0, done.stderr[-3000:]
    done = S.cli("export", "peft", "--adapter", run, "--load-hf", models["wide"], "--save", peft)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "note: the adapter was trained on an NF4 base (--base-quantization nf4); it is an " \
        "ordinary PEFT LoRA adapter" in done.stderr, done.stderr[-2000:]
    from megatron_lora.cli.export import trained_on_nf4  # what export hf says too

    assert trained_on_nf4(run)
    done = S.cli("logits", "--load-hf", models["wide"], "--adapter", run, "--tokens",
                 models["tokens"], "--out", out, "--base-quantization", "nf4")
    assert done.returncode == 0, done.stderr[-3000:]
    ours = load_file(out)["logits"]
    tokens = torch.tensor(json.load(open(models["tokens"])))
    reference = S.peft_logits(models["wide_nf4"], peft, tokens)
    diff = (ours - reference).abs().max().item()
    assert diff <= 1e-4, f"max abs diff {diff:.3e} vs PEFT on the NF4 round trip"
    prompts, completions = str(tmp_path / "prompts.jsonl"), str(tmp_path / "out.jsonl")
    with open(prompts, "w") as f:
        f.write(json.dumps({"prompt": "q1?"}) + "\n")
    done = S.cli("generate", "--load-hf", models["wide"], "--adapter", run, "--tokenizer",
                 "byte", "--prompts", prompts, "--out", completions, "--max-new-tokens", "3",
                 "--base-quantization", "nf4")
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = open(completions).read().splitlines()
    assert 1 <= len(json.loads(line)["token_ids"]) <= 3
    # The adapter matters and the base is the round trip, not the full-precision weights.
    assert (ours - S.hf_logits(models["wide_nf4"], tokens)).abs().max().item() > 1e-3
    assert (ours - S.peft_logits(models["wide"], peft, tokens)).abs().max().item() > 1e-2
