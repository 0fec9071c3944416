"""`train --adapter` (Megatron-LM's --finetune semantics) and `--valid-data-path`, as a user runs
them: two one-process runs of the tiny example, checked against losses computed independently
with transformers (the HF Mixtral with each adapter's update B A * alpha / r added to o_proj).

Run A starts from a PEFT adapter folder (random non-zero factors, imported on the fly), takes
most flags from a --config file and validates on --valid-data-path. Run B starts from run A's
checkpoint (which holds Adam moments and iteration 2) with run A's saved run_config.yaml as
--config. Checked: the first iteration's loss is the starting adapter's loss; the validation
loss is the loss of the iteration's adapter on the validation file; iterations count from 1; the
optimizer is fresh (Adam's first step moves every factor element by the learning rate)."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch

R, ALPHA, SEQ, GBS, LR = 4, 8.0, 32, 4, 2e-3


def _texts(n, seed):
    """n texts longer than SEQ + 1 bytes: each fills one packed row alone (truncated)."""
    g = torch.Generator().manual_seed(seed)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    out = []
    for _ in range(n):
        idx = torch.randint(len(words), (12,), generator=g).tolist()
        out.append(" ".join(words[i] for i in idx))
    return out


def _write_jsonl(path, texts):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


def _peft_adapter(directory, layers, hidden, seed=11):
    """A PEFT LoRA folder on every layer's o_proj with random non-zero factors."""
    from safetensors.torch import save_file

    os.makedirs(directory)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        key = f"base_model.model.model.layers.{i}.self_attn.o_proj"
        tensors[f"{key}.lora_A.weight"] = torch.randn(R, hidden, generator=g) * 0.3
        tensors[f"{key}.lora_B.weight"] = torch.randn(hidden, R, generator=g) * 0.3
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": ["o_proj"],
                   "use_rslora": False, "lora_dropout": 0.0, "bias": "none"}, f)
    return {i: (tensors[f"base_model.model.model.layers.{i}.self_attn.o_proj.lora_A.weight"],
                tensors[f"base_model.model.model.layers.{i}.self_attn.o_proj.lora_B.weight"])
            for i in range(layers)}


def _checkpoint_factors(path, hf):
    """{layer: (A, B)} of the linear_proj adapters of one of our adapter checkpoints."""
    from megatron_lora.export.adapter_ckpt import AdapterCheckpoint
    from megatron_lora.export.table import KINDS, sites
    from megatron_lora.families import read_hf_config

    info = read_hf_config(hf)
    ckpt = AdapterCheckpoint(path, info)
    kind = next(k for k in KINDS if k.name == "linear_proj")
    return {s.index[0]: tuple(t.float() for t in ckpt.factors(s)) for s in sites(info, kind)}


def _first_batch(path, seed):
    """The first global batch train/evaluate reads from a JSONL file (one sample per row)."""
    from megatron_lora.data import PackedDataset, load_tokenizer, pack_samples, read_jsonl

    tok = load_tokenizer("byte")
    samples, _ = read_jsonl(path, tok, max_tokens=SEQ + 1)
    rows = pack_samples(samples, SEQ, tok.pad_id)
    assert rows.tokens.shape[0] == len(samples)  # one sample per row: plain causal attention
    return PackedDataset(rows, seed=seed).batch(0, GBS)


def _hf_loss(hf, factors, batch, dtype=torch.float32):
    """Mean token loss of the HF Mixtral with o_proj += alpha / r * B A, in `dtype`."""
    from transformers import AutoModelForCausalLM

    # eager experts: torch's grouped matmul has no fp64 kernel, and both precisions must
    # evaluate the same computation (compare.reference_bound)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32,
                                                 experts_implementation="eager").to(dtype).eval()
    with torch.no_grad():
        for i, (a, b) in factors.items():
            model.model.layers[i].self_attn.o_proj.weight += (ALPHA / R) * (b.double() @ a.double()
                                                                            ).to(dtype)
        logits = model(batch.tokens).logits.double()
    mask = batch.loss_mask.bool()
    return float(torch.nn.functional.cross_entropy(logits[mask], batch.labels[mask]))


def _assert_loss(got, hf, factors, batch, what):
    """Our logged loss against transformers' fp32 loss of the same adapter and batch:
    compare.mean_loss_bound from transformers' own fp32 rounding (its fp64 evaluation), over
    the batch's target tokens, plus half a unit of the log line's last digit (%.6E)."""
    from megatron_lora.testing import compare

    want = _hf_loss(hf, factors, batch)
    want64 = _hf_loss(hf, factors, batch, torch.float64)
    shown = 0.5 * 10.0 ** (math.floor(math.log10(abs(got))) - 6)
    bound = compare.mean_loss_bound(torch.tensor([want]),
                                    torch.tensor([want64], dtype=torch.float64),
                                    int(batch.loss_mask.sum())) + shown
    compare.assert_within(torch.tensor([got]), torch.tensor([want]), bound, what)
    return want


def _train(args):
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["MASTER_PORT"] = str(29400 + os.getpid() % 200)
    out = subprocess.run([sys.executable, "-m", "megatron_lora", "train", *args],
                         capture_output=True, text=True, env=env,
                         timeout=2 * float(os.environ.get("MLORA_TEST_TIMEOUT", "300")))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def _losses(text):
    return {int(i): float(v) for i, v in
            re.findall(r"iteration\s+(\d+)/\s*\d+ .*?lm loss: ([0-9.E+-]+)", text)}


def _validation(text):
    return {int(i): float(v) for i, v in
            re.findall(r"validation\D*?(\d+)\D.*?lm loss: ([0-9.E+-]+)", text)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_example):
    root = tmp_path_factory.mktemp("finetune")
    tiny = tiny_example(root / "tiny", samples=8)
    hf = os.path.join(tiny, "hf")
    _write_jsonl(root / "train.jsonl", _texts(12, seed=1))
    _write_jsonl(root / "valid.jsonl", [t.upper() for t in _texts(6, seed=2)])
    cfg = json.load(open(os.path.join(hf, "config.json")))
    start = _peft_adapter(str(root / "peft"), cfg["num_hidden_layers"], cfg["hidden_size"])
    config = root / "a.yaml"  # both spellings of keys, a list, a switch left false
    config.write_text(f"""
load-hf: {hf}
data_path: {root / 'train.jsonl'}
tokenizer: byte
seq-length: {SEQ}
micro_batch_size: 1
global-batch-size: {GBS}
lr: {LR}
lr-warmup-iters: 0
lr-decay-style: constant
seed: 3
log-interval: 1
bf16: false
""")
    run_a, run_b = str(root / "a"), str(root / "b")
    out_a = _train(["--config", str(config), "--adapter", str(root / "peft"),
                    "--valid-data-path", str(root / "valid.jsonl"), "--eval-interval", "1",
                    "--train-iters", "2", "--save", run_a, "--save-interval", "1"])
    saved_config = os.path.join(run_a, "iter_0000002", "run_config.yaml")
    out_b = _train(["--config", saved_config, "--adapter", run_a, "--save", run_b,
                    "--train-iters", "1"])
    return dict(root=root, hf=hf, start=start, a=run_a, b=run_b, out_a=out_a, out_b=out_b,
                saved_config=saved_config)


def test_first_loss_is_the_starting_adapters_loss(runs):
    root, hf = runs["root"], runs["hf"]
    train_batch = _first_batch(str(root / "train.jsonl"), seed=3)
    # Run A: from the PEFT folder (imported on the fly).
    got_a = _losses(runs["out_a"])
    assert sorted(got_a) == [1, 2], runs["out_a"][-3000:]
    want_a = _assert_loss(got_a[1], hf, runs["start"], train_batch, "run A's first loss")
    base = _hf_loss(hf, {}, train_batch)
    assert abs(want_a - base) > 1e-3  # the adapter changes the loss far beyond the tolerance
    # Run B: from run A's final checkpoint.
    got_b = _losses(runs["out_b"])
    assert sorted(got_b) == [1], runs["out_b"][-3000:]
    want_b = _assert_loss(got_b[1], hf,
                          _checkpoint_factors(os.path.join(runs["a"], "iter_0000002"), hf),
                          train_batch, "run B's first loss")
    assert abs(want_b - want_a) > 1e-4


def test_validation_loss_comes_from_valid_data_path(runs):
    root, hf = runs["root"], runs["hf"]
    valid = _validation(runs["out_a"])
    assert sorted(valid) == [1, 2], runs["out_a"][-3000:]
    after_1 = _checkpoint_factors(os.path.join(runs["a"], "iter_0000001"), hf)
    want = _assert_loss(valid[1], hf, after_1, _first_batch(str(root / "valid.jsonl"), seed=3),
                        "validation loss of iteration 1")
    on_train = _hf_loss(hf, after_1, _first_batch(str(root / "train.jsonl"), seed=3))
    assert abs(on_train - want) > 1e-3
    assert "validation sequences from --valid-data-path" in runs["out_a"]


def test_iterations_and_optimizer_start_fresh(runs):
    out_b = runs["out_b"]
    assert "resumed from" not in out_b
    assert "trained 1 iteration (1)" in out_b, out_b[-2000:]
    assert sorted(os.listdir(runs["b"])) >= ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert "initial adapter weights from --adapter" in out_b
    # Adam's first step (fresh moments, bias-corrected) moves every element by lr * g / (|g| +
    # eps) ~ lr; moments loaded from run A (2 steps) would give other step sizes. Within 1e-2 of
    # lr: |step / lr - 1| = eps / (|g| + eps) + the fp32 rounding of p + step (2**-24 |p| / lr,
    # under 1e-4 for |p| < 3), below 1e-2 wherever |g| >= 99 eps = 1e-6; a step from loaded
    # moments is m_hat / sqrt(v_hat) of three gradients, off 1 by more unless they agree.
    before = _checkpoint_factors(os.path.join(runs["a"], "iter_0000002"), runs["hf"])
    after = _checkpoint_factors(os.path.join(runs["b"], "iter_0000001"), runs["hf"])
    steps = torch.cat([(after[i][k] - before[i][k]).abs().flatten()
                       for i in before for k in (0, 1)])
    close = ((steps / LR - 1).abs() < 1e-2).float().mean()
    assert close > 0.95, f"{float(close):.3f} of the elements moved by lr"


def test_run_config_is_saved_and_reproduces_the_flags(runs):
    import yaml

    from megatron_lora.cli import build_parser

    out_a = runs["out_a"]
    for it in (1, 2):
        assert f"saved checkpoint of iteration {it} to {runs['a']}/iter_000000{it}" in out_a
    assert "loading the base model (--load-hf" in out_a and "loaded the base model in" in out_a
    saved = yaml.safe_load(open(runs["saved_config"]))
    assert saved["adapter"] == str(runs["root"] / "peft")
    assert saved["valid-data-path"] == str(runs["root"] / "valid.jsonl")
    # The LoRA settings recorded are the adapter's, not the flags' defaults.
    assert (saved["lora-rank"], saved["lora-alpha"], saved["lora-target-modules"]) == (
        R, ALPHA, ["linear_proj"])
    again = vars(build_parser().parse_args(["train", "--config", runs["saved_config"]]))
    assert saved["train-iters"] == again["train_iters"] == 2
    assert again["save"] == runs["a"] and again["lr"] == LR and again["seed"] == 3
    b_saved = yaml.safe_load(open(os.path.join(runs["b"], "iter_0000001", "run_config.yaml")))
    assert b_saved["adapter"] == runs["a"] and b_saved["save"] == runs["b"]
