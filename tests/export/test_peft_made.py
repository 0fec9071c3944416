"""Adapters made by PEFT itself (random non-zero factors) -> import peft -> megatron_lora.

Attention adapters with separate q/k/v factors are stacked; our `logits --adapter` equals PEFT's
logits. Adapters on every Mixtral module (experts, router, embeddings, lm_head) in transformers 5's
fused layout and in the per-expert layout: every HF module's update scale * B A from the
imported checkpoint equals the update PEFT itself computes (get_delta_weight)."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_lora.export.adapter_ckpt import AdapterCheckpoint
from megatron_lora.export.from_peft import import_peft
from megatron_lora.export.table import module_of, sites
from megatron_lora.families import read_hf_config
from megatron_lora.testing import compare
from tests.convert.tiny import TINY_CONFIG
from tests.export import _support as S

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate", "embed_tokens", "lm_head"]
FUSED = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _peft_adapter(hf_dir, out, seed, **kw):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(S.hf_model(hf_dir), LoraConfig(init_lora_weights=False, **kw))
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("rslora", [False, True], ids=["alpha/r", "rslora"])
def test_separate_qkv_adapters_stack_and_match_peft_logits(tiny, tmp_path, rslora):
    # q, k, v each with their own A; v has another rank, q another alpha: stacked rank 2+2+3.
    peft_dir = _peft_adapter(tiny["hf"], str(tmp_path / "peft"), seed=7, r=2, lora_alpha=4,
                             use_rslora=rslora, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             rank_pattern={"v_proj": 3}, alpha_pattern={"q_proj": 5})
    save = str(tmp_path / "imported")
    proc = S.cli("import", "peft", "--adapter", peft_dir, "--load-hf", tiny["hf"], "--save", save)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'linear_qkv': 7" in proc.stderr and "'linear_proj': 2" in proc.stderr
    out = str(tmp_path / "logits.safetensors")
    proc = S.cli("logits", "--load-hf", tiny["hf"], "--adapter", save, "--tokens", tiny["tokens"],
                 "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = torch.tensor(json.load(open(tiny["tokens"])))
    ours, peft = load_file(out)["logits"], S.in_both(S.peft_logits, tiny["hf"], peft_dir, tokens)
    bound = S.assert_near_reference(ours, peft, "logits --adapter vs transformers + PEFT")
    S.assert_moved(peft[0], S.hf_logits(tiny["hf"], tokens), bound, "PEFT's adapter")


def _peft_deltas(hf_dir, peft_dir):
    """{HF weight name (per-expert names): PEFT's own update} for every adapted module."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    model = PeftModel.from_pretrained(S.hf_model(hf_dir), peft_dir).base_model.model
    f = TINY_CONFIG["intermediate_size"]
    out = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, LoraLayer) or not mod.r:
            continue
        delta = mod.get_delta_weight("default").detach().float()
        param = getattr(mod, "parameter_name", None)
        layer = name.replace(".base_layer", "").replace(".mlp.", ".block_sparse_moe.")
        if param == "gate_up_proj":
            for e in range(delta.shape[0]):
                out[f"{layer}.{e}.w1.weight"] = delta[e, :f]
                out[f"{layer}.{e}.w3.weight"] = delta[e, f:]
        elif param == "down_proj":
            for e in range(delta.shape[0]):
                out[f"{layer}.{e}.w2.weight"] = delta[e]
        else:
            out[f"{layer}.weight"] = delta
    return out


def _our_deltas(hf_dir, ckpt_dir):
    """{HF weight name: (scale * B A, its bound against PEFT's)} of every adapter in an imported
    checkpoint, split by the mapping table (padded vocabulary dropped). Each side forms an
    r-term fp32 dot product (PEFT's r at most ours: stacked q/k/v add zeros), rounds the scale
    to fp32 and multiplies once: within (r + 2) u of exact relative to |scale| |B| @ |A|
    (Higham eq. 4.4), so the two within twice that, element by element."""
    info = read_hf_config(hf_dir)
    ckpt = AdapterCheckpoint(ckpt_dir, info)
    out = {}
    for kind in ckpt.kinds():
        for site in sites(info, kind):
            a, b = (t.float() for t in ckpt.factors(site))
            _, _, scale = ckpt.scaling(site)
            delta = scale * (b @ a)
            bound = 2 * (b.shape[-1] + 2) * compare.unit_roundoff(torch.float32) * abs(scale) \
                * (b.abs() @ a.abs())
            if kind.name == "embedding":
                out["model.embed_tokens.weight"] = tuple(t.t()[:info.vocab_size]
                                                         for t in (delta, bound))
                continue
            for part in site.parts:
                rows = slice(part.row0, part.row0 + part.rows)
                bounds = part.source.split(bound[rows])
                out.update({k: (v, bounds[k]) for k, v in part.source.split(delta[rows]).items()})
    return out


def _compare(tiny, peft_dir, save):
    report = import_peft(peft_dir, save, hf_config=tiny["hf"])
    ours, theirs = _our_deltas(tiny["hf"], save), _peft_deltas(tiny["hf"], peft_dir)
    assert sorted(theirs) == sorted(n for n in ours if n in theirs)
    for name, delta in theirs.items():
        assert delta.abs().max() > 0, name
        compare.assert_within(ours[name][0], delta, ours[name][1],
                              f"{name}: scale x B @ A vs PEFT's")
    untouched = [n for n in ours if n not in theirs]  # parts of fused sites PEFT did not target
    assert all(ours[n][0].abs().max() == 0 for n in untouched)
    return report


def test_fused_layout_every_module(tiny, tmp_path):
    peft_dir = _peft_adapter(tiny["hf"], str(tmp_path / "peft"), seed=11, r=3, lora_alpha=5,
                             target_modules=ALL_MODULES, target_parameters=FUSED)
    report = _compare(tiny, peft_dir, str(tmp_path / "imported"))
    assert report["ranks"] == {"embedding": 3, "linear_qkv": 9, "linear_proj": 3, "router": 3,
                               "linear_fc1": 3, "linear_fc2": 3, "output_layer": 3}


def test_per_expert_layout(tiny, tmp_path):
    """Per-expert keys (transformers 4 names, what vLLM exchanges), w1 and w3 with their own A;
    PEFT on transformers 5 loads them by fusing, our import by stacking."""
    peft_dir = _peft_adapter(tiny["hf"], str(tmp_path / "peft"), seed=13, r=2, lora_alpha=3,
                             target_modules=["q_proj", "o_proj"])
    path = os.path.join(peft_dir, "adapter_model.safetensors")
    tensors = load_file(path)
    cfg = TINY_CONFIG
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    g = torch.Generator().manual_seed(17)
    for layer in range(cfg["num_hidden_layers"]):
        for e in range(cfg["num_local_experts"]):
            for w, (out_f, in_f) in {"w1": (f, h), "w3": (f, h), "w2": (h, f)}.items():
                p = f"base_model.model.model.layers.{layer}.block_sparse_moe.experts.{e}.{w}"
                tensors[f"{p}.lora_A.weight"] = torch.randn(2, in_f, generator=g) * 0.1
                tensors[f"{p}.lora_B.weight"] = torch.randn(out_f, 2, generator=g) * 0.1
    save_file(tensors, path)
    config_path = os.path.join(peft_dir, "adapter_config.json")
    config = json.load(open(config_path))
    config["target_modules"] = ["q_proj", "o_proj", "w1", "w2", "w3"]
    json.dump(config, open(config_path, "w"))
    report = _compare(tiny, peft_dir, str(tmp_path / "imported"))
    assert report["ranks"] == {"linear_qkv": 2, "linear_proj": 2, "linear_fc1": 4, "linear_fc2": 2}
