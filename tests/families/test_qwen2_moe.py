"""Qwen2-MoE against transformers 5.24's own Qwen2MoeForCausalLM and PEFT 0.21.

A tiny random model made by transformers in the test: q/k/v biases, a shared expert beside 4
routed experts with its sigmoid gate, norm_topk_prob false (and a tied variant with true), norms
moved off 1. The same checks as every family (tests/families/_support.py): config and refusals,
the tensors megatron builds are the mapping's, bit-identical round trip, logits within 1e-4 at
1 rank, PP2xEP2, TP2xEP2+SP and ETP2 (grouped), and LoRA on every linear kind - the shared
expert's included - trained at PP2xEP2 as at one rank, exported to PEFT (logits), imported and
generated with.
"""

import json
import os

import pytest

from megatron_lora.families import ModelConfigError, model_info
from megatron_lora.families.qwen2_moe import QWEN2_MOE
from megatron_lora.runtime import ParallelLayout
from tests.families import _support as F

CONFIG = dict(vocab_size=250, hidden_size=64, intermediate_size=80, moe_intermediate_size=48,
              shared_expert_intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
              max_position_embeddings=128, initializer_range=0.1, rms_norm_eps=1e-6,
              architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe")
VARIANTS = {"hf": {}, "tied": dict(tie_word_embeddings=True, norm_topk_prob=True)}


def make(directory: str, seed: int = 0, **overrides) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    torch.manual_seed(seed)
    cfg = {k: v for k, v in dict(CONFIG, **overrides).items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(Qwen2MoeConfig(**cfg)).float()
    F.perturb_norms(model)
    with torch.no_grad():  # biases start at zero: move them, or a lost bias goes unseen
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(directory, max_shard_size="200KB")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return F.convert_and_reference(str(tmp_path_factory.mktemp("qwen2_moe")), make, VARIANTS)


def test_config_gives_the_sizes_megatron_builds():
    info = model_info(CONFIG)
    s = info.shape
    assert info.family is QWEN2_MOE and info.head_dim == 16 and not s.qk_layernorm
    assert s.add_qkv_bias and s.shared_expert_ffn_hidden_size == 40 and s.shared_expert_gate
    assert s.moe_router_pre_softmax and (s.ffn_hidden_size, s.num_experts) == (48, 4)
    assert not model_info(dict(CONFIG, qkv_bias=False)).shape.add_qkv_bias


@pytest.mark.parametrize("change,message", [
    (dict(mlp_only_layers=[0]), "field mlp_only_layers=[0]: dense layers"),
    (dict(decoder_sparse_step=2), "field decoder_sparse_step=2: dense layers"),
    (dict(shared_expert_intermediate_size=0),
     "field 'shared_expert_intermediate_size' must be a positive integer, got 0"),
    (dict(use_sliding_window=True, sliding_window=64), "field sliding_window=64 is smaller"),
    (dict(qkv_bias="true"), "field 'qkv_bias' must be true or false"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "only unscaled ('default') RoPE"),
])
def test_what_megatron_cannot_reproduce_is_refused_naming_the_field(change, message):
    with pytest.raises(ModelConfigError) as err:
        model_info(dict(CONFIG, **change), source="/m/config.json")
    assert str(err.value).startswith("/m/config.json: ") and message in str(err.value), err.value


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2, sp=True), ParallelLayout(pp=2)],
                         ids=["TP2+SP", "PP2"])
def test_megatron_builds_the_tensors_of_the_mapping(layout, qwen2):
    F.structure_matches_megatron(paths=qwen2, name="hf", layout=layout)


def test_round_trip_is_bit_identical(qwen2, tmp_path):
    from megatron_lora.convert.mcore_to_hf import mcore_to_hf
    from tests.convert.test_roundtrip import assert_bit_identical, read_hf_tensors

    out = str(tmp_path / "hf_out")
    mcore_to_hf(qwen2["mcore"], out, max_shard_bytes=200_000, progress=False)
    original = read_hf_tensors(qwen2["hf"])
    assert any(k.endswith("mlp.shared_expert_gate.weight") for k in original)
    assert any(k.endswith("self_attn.q_proj.bias") for k in original)
    assert_bit_identical(original, read_hf_tensors(out))
    assert json.load(open(os.path.join(out, "config.json")))["shared_expert_intermediate_size"] == 40


@pytest.mark.parametrize("layout,grouped,world_size", [
    pytest.param(ParallelLayout(), False, 1, id="1rank"),
    pytest.param(ParallelLayout(pp=2, ep=2), False, 4, id="PP2xEP2"),
    pytest.param(ParallelLayout(tp=2, ep=2, sp=True), False, 4, id="TP2xEP2+SP"),
    pytest.param(ParallelLayout(ep=1, etp=2), True, 2, id="ETP2-grouped"),
])
def test_logits_match_transformers(layout, grouped, world_size, qwen2):
    F.logits_at_layout(layout=layout, grouped=grouped, world_size=world_size, paths=qwen2,
                       variants=list(VARIANTS))
