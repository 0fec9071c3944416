"""Qwen3-MoE against transformers 5.24's own Qwen3MoeForCausalLM and PEFT 0.21.

A tiny random model made by transformers in the test (head_dim 24 with hidden 64 and 4 heads, so
q is wider than the hidden size; q/k norm weights and layer norms moved off 1; norm_topk_prob
false, and a tied variant with true):

- config.json reads into the right sizes, and what megatron-core cannot reproduce is refused
  naming the field;
- convert -> megatron -> HF is bit-identical; `logits` from the converted checkpoint and from the
  HF folder equal transformers' within 1e-4 at 1 rank, PP2xEP2, TP2xEP2+SP and ETP2 (grouped and
  sequential experts);
- `train` with LoRA on every linear kind (attention, router, experts, embedding, output layer;
  dropout 0.1, rsLoRA) at PP2xEP2 gives the one-rank run's losses and adapter; its PEFT export
  loads in transformers + PEFT with the logits of `logits --adapter` at TP2+SP (1e-4); import of
  the export is bit-identical; greedy `generate --adapter` gives transformers + PEFT's tokens.
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_lora.families import ModelConfigError, model_info
from megatron_lora.families.qwen3_moe import QWEN3_MOE
from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing import parity
from tests.convert.tiny import make_tokens
from tests.export import _support as S
from tests.harness import multirank

TOL = 1e-4
CONFIG = dict(vocab_size=250, hidden_size=64, intermediate_size=80, moe_intermediate_size=48,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
              num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
              initializer_range=0.1, norm_topk_prob=False, rms_norm_eps=1e-6,
              architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")


def make_tiny(directory: str, seed: int = 0, **overrides) -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    cfg = {k: v for k, v in dict(CONFIG, **overrides).items() if k not in ("model_type",)}
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**cfg)).float()
    with torch.no_grad():  # norms of 1 would hide a norm applied to the wrong axis or not at all
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory, max_shard_size="200KB")


def hf_model(directory: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        directory, attn_implementation="eager", experts_implementation="eager",
        dtype=torch.float32).eval()


@torch.no_grad()
def hf_logits(directory: str, tokens: torch.Tensor, adapter: str = None) -> torch.Tensor:
    model = hf_model(directory)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    return model(tokens).logits.float()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A tiny HF Qwen3-MoE, its conversion, token ids and transformers' logits; and a tied
    variant with norm_topk_prob true."""
    from megatron_lora.convert.hf_to_mcore import hf_to_mcore

    root = tmp_path_factory.mktemp("qwen3_moe")
    paths = {k: str(root / k) for k in ("hf", "mcore", "tied", "tied_mcore")}
    make_tiny(paths["hf"])
    make_tiny(paths["tied"], seed=2, tie_word_embeddings=True, norm_topk_prob=True)
    hf_to_mcore(paths["hf"], paths["mcore"], progress=False)
    tokens = make_tokens(batch=2, seq=12)
    paths["tokens"] = S.write_tokens(str(root / "tokens.json"), tokens)
    paths["reference"] = str(root / "reference.safetensors")
    save_file({"tokens": tokens, "logits": hf_logits(paths["hf"], tokens).contiguous(),
               "tied": hf_logits(paths["tied"], tokens).contiguous()}, paths["reference"])
    paths["root"] = str(root)
    return paths


# ---- config.json ----

def test_config_gives_the_sizes_megatron_builds():
    info = model_info(CONFIG)
    s = info.shape
    assert info.family is QWEN3_MOE and info.head_dim == 24 and s.kv_channels == 24
    assert s.qk_layernorm and s.moe_router_pre_softmax  # norm_topk_prob false: no renormalising
    assert (s.ffn_hidden_size, s.num_experts, s.moe_router_topk) == (48, 4, 2)
    assert s.vocab_size == 256 and info.vocab_size == 250 and s.rotary_base == 10000.0
    assert not model_info(dict(CONFIG, norm_topk_prob=True)).shape.moe_router_pre_softmax
    saved = {k: v for k, v in CONFIG.items() if k != "num_experts"}  # transformers 5's own save
    assert model_info(dict(saved, num_local_experts=4)).shape.num_experts == 4


@pytest.mark.parametrize("change,message", [
    (dict(mlp_only_layers=[1]), "field mlp_only_layers=[1]: dense layers"),
    (dict(decoder_sparse_step=2), "field decoder_sparse_step=2: dense layers"),
    (dict(attention_bias=True), "field attention_bias=true"),
    (dict(use_sliding_window=True, sliding_window=64), "field sliding_window=64 is smaller"),
    (dict(hidden_act="gelu"), "field hidden_act='gelu': only 'silu'"),
    (dict(norm_topk_prob="yes"), "field 'norm_topk_prob' must be true or false"),
    (dict(moe_intermediate_size=0), "field 'moe_intermediate_size' must be a positive integer"),
])
def test_what_megatron_cannot_reproduce_is_refused_naming_the_field(change, message):
    with pytest.raises(ModelConfigError) as err:
        model_info(dict(CONFIG, **change), source="/m/config.json")
    assert str(err.value).startswith("/m/config.json: ") and message in str(err.value), err.value


# ---- conversion and logits ----

def test_round_trip_is_bit_identical(qwen3, tmp_path):
    from megatron_lora.convert.mcore_to_hf import mcore_to_hf
    from tests.convert.test_roundtrip import assert_bit_identical, read_hf_tensors

    out = str(tmp_path / "hf_out")
    mcore_to_hf(qwen3["mcore"], out, max_shard_bytes=200_000, progress=False)
    original = read_hf_tensors(qwen3["hf"])
    assert any(k.endswith("self_attn.q_norm.weight") for k in original)
    assert_bit_identical(original, read_hf_tensors(out))
    assert json.load(open(os.path.join(out, "config.json")))["head_dim"] == 24


LAYOUTS = [
    pytest.param(ParallelLayout(), False, 1, id="1rank"),
    pytest.param(ParallelLayout(pp=2, ep=2), False, 4, id="PP2xEP2"),
    pytest.param(ParallelLayout(tp=2, ep=2, sp=True), False, 4, id="TP2xEP2+SP"),
    pytest.param(ParallelLayout(ep=1, etp=2), True, 2, id="ETP2-grouped"),
]


@pytest.mark.parametrize("layout,grouped,world_size", LAYOUTS)
@multirank(world_size=lambda world_size, **_: world_size, timeout=600)
def test_logits_match_transformers(layout, grouped, world_size, qwen3):
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf, load_mcore
    from megatron_lora.convert.logits import forward_logits
    from megatron_lora.models.build import build_model, model_config

    ref = load_file(qwen3["reference"])

    def logits(hf_dir, load):
        info, hf, _ = open_hf(hf_dir)
        model = build_model(info, model_config(info, layout), moe_grouped_gemm=grouped)
        load(model, info, hf)
        return forward_logits(model, ref["tokens"], info.vocab_size)

    from_mcore = logits(qwen3["hf"], lambda m, i, h: load_mcore(m, qwen3["mcore"]))
    from_hf = logits(qwen3["hf"], load_hf)
    tied = logits(qwen3["tied"], load_hf)
    if parity.assert_held_by(from_mcore, 1, "the logits"):
        for got, want in ((from_mcore, ref["logits"]), (from_hf, ref["logits"]),
                          (tied, ref["tied"])):
            assert got.shape == want.shape == (2, 12, 250)
            diff = (got - want).abs().max().item()
            assert diff <= TOL, f"{layout.describe()}: max abs diff {diff:.3e} vs transformers"


# ---- LoRA: train at two layouts, export to PEFT, import, generate ----

TARGETS = ["linear_qkv", "linear_proj", "router", "linear_fc1", "linear_fc2", "embedding",
           "output_layer"]
PROMPTS = [{"prompt": "hello there how are you"}, {"prompt": "the sky is blue"}]
NEW_TOKENS = 6


def _ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _run(*args, nproc: int, port: int):
    """`megatron-lora ARGS` under torchrun (also for one rank: a port of its own)."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(port), "-m", "megatron_lora", *args]
    return _ok(subprocess.run(cmd, cwd=S.ROOT, env=env, capture_output=True, text=True,
                              timeout=900))


def _text(path: str) -> str:
    import random

    rnd = random.Random(0)
    words = "hello there how are you the sky is blue fine thank colour lamp star".split()
    with open(path, "w") as f:
        for _ in range(16):
            f.write(json.dumps({"text": " ".join(rnd.choice(words) for _ in range(10))}) + "\n")
    return path


@pytest.fixture(scope="module")
def trained(qwen3):
    """The same LoRA run (3 steps) at 1 rank and at PP2xEP2 (4 ranks), the PEFT export of the
    4-rank run and `logits --adapter` of it at TP2+SP."""
    from megatron_lora.export.to_peft import export_peft
    from tests.data.tiny_tokenizers import mistral_folder

    root = qwen3["root"]
    paths = dict(qwen3, tok=mistral_folder(os.path.join(root, "tok"), vocab_size=250))
    data = _text(os.path.join(root, "text.jsonl"))
    args = ["train", "--load-hf", qwen3["hf"], "--tokenizer", paths["tok"], "--data-path", data,
            "--seq-length", "16", "--global-batch-size", "4", "--train-iters", "3", "--lr", "2e-2",
            "--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1", "--lora-use-rslora",
            "--lora-target-modules", *TARGETS, "--seed", "3", "--log-interval", "1"]
    for name, flags, nproc in (("run1", [], 1),
                               ("run4", ["--pipeline-model-parallel-size", "2",
                                         "--expert-model-parallel-size", "2"], 4)):
        paths[name] = os.path.join(root, name)
        _run(*args, *flags, "--save", paths[name], nproc=nproc, port=29611)
    paths["peft"] = os.path.join(root, "peft")
    export_peft(paths["run4"], paths["peft"], hf_config=qwen3["hf"])
    paths["logits"] = os.path.join(root, "logits.safetensors")
    _run("logits", "--load-hf", qwen3["hf"], "--adapter", paths["run4"], "--tokens",
         qwen3["tokens"], "--out", paths["logits"], "--tensor-model-parallel-size", "2",
         "--sequence-parallel", nproc=2, port=29612)
    return paths


def _adapter_tensors(run: str):
    from megatron_lora.convert.dcp_read import TorchDistCheckpoint
    from megatron_lora.training.checkpoint import resolve

    ckpt = TorchDistCheckpoint(resolve(run))
    return {k: ckpt.read(k, (0,) * len(ckpt.shape(k)), ckpt.shape(k)) for k in ckpt.tensors
            if not k.startswith("optimizer.")}


def test_training_at_pp2_ep2_is_the_one_rank_run(trained):
    from megatron_lora.training.logging import read_metrics

    losses = [[r["lm loss"] for r in read_metrics(os.path.join(trained[run], "metrics.jsonl"))
               if "lm loss" in r] for run in ("run1", "run4")]
    assert len(losses[0]) == 3 and losses[0][-1] < losses[0][0]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    one, four = _adapter_tensors(trained["run1"]), _adapter_tensors(trained["run4"])
    assert sorted(one) == sorted(four) and any("q_layernorm" in k for k in one) is False
    kinds = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in one}
    assert {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "word_embeddings",
            "output_layer", "lora"} <= kinds, kinds
    for key in one:  # Adam's steps are 2e-2 each: 1e-5 is 5e-4 of one step
        torch.testing.assert_close(four[key], one[key], rtol=1e-4, atol=1e-5, msg=key)


def test_peft_export_loads_in_transformers_with_our_logits(trained):
    config = json.load(open(os.path.join(trained["peft"], "adapter_config.json")))
    assert config["auto_mapping"]["base_model_class"] == "Qwen3MoeForCausalLM"
    assert sorted(config["target_modules"]) == sorted(
        ["embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate", "gate_proj", "up_proj",
         "down_proj", "lm_head"])
    # rsLoRA written as plain LoRA with alpha x sqrt(r): PEFT's fused gate_up doubles r and alpha
    assert config["use_rslora"] is False and config["lora_alpha"] == 16.0 and config["r"] == 4
    tokens = torch.tensor(json.load(open(trained["tokens"])))
    ours = load_file(trained["logits"])["logits"]
    peft = hf_logits(trained["hf"], tokens, adapter=trained["peft"])
    base = hf_logits(trained["hf"], tokens)
    assert (ours - base).abs().max().item() > 100 * TOL  # the adapter changes the logits
    diff = (ours - peft).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff:.3e} vs transformers + PEFT"


def test_import_of_the_export_is_bit_identical(trained, tmp_path):
    from megatron_lora.export.from_peft import import_peft

    import_peft(trained["peft"], str(tmp_path / "back"), hf_config=trained["hf"])
    original, back = _adapter_tensors(trained["run4"]), _adapter_tensors(str(tmp_path / "back"))
    assert sorted(original) == sorted(back)
    real = {"embedding.word_embeddings.lora_A": (slice(None), slice(0, 250)),  # [r, Vp]
            "output_layer.lora_B": (slice(0, 250),)}  # [Vp, r]: padded rows are not exported
    for key in original:
        a, b = (t[real.get(key, ())] for t in (original[key], back[key]))
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), key


@torch.no_grad()
def _peft_greedy(trained):
    from peft import PeftModel
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(trained["tok"])
    model = PeftModel.from_pretrained(hf_model(trained["hf"]), trained["peft"]).eval()
    out = []
    for p in PROMPTS:
        ids = tok(p["prompt"]).input_ids
        new = []
        for _ in range(NEW_TOKENS):
            nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            new.append(nxt)
            if nxt == tok.eos_token_id:
                break
        out.append(new)
    return out


def test_greedy_generate_with_the_adapter_is_transformers_peft(trained, tmp_path):
    prompts, out = str(tmp_path / "prompts.jsonl"), str(tmp_path / "out.jsonl")
    with open(prompts, "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in PROMPTS)
    _run("generate", "--load-hf", trained["hf"], "--adapter", trained["run4"], "--tokenizer",
         trained["tok"], "--prompts", prompts, "--out", out, "--max-new-tokens", str(NEW_TOKENS),
         "--tensor-model-parallel-size", "2", "--sequence-parallel", nproc=2, port=29613)
    rows = [json.loads(line) for line in open(out)]
    assert [r["token_ids"] for r in rows] == _peft_greedy(trained)
