"""Qwen2-MoE against transformers 5.24's own Qwen2MoeForCausalLM and PEFT 0.21.

A tiny random model made by transformers in the test: q/k/v biases, a shared expert beside 4
routed experts with its sigmoid gate, norm_topk_prob false, dense layers 0 and 3
(`mlp_only_layers`: SwiGLU MLPs of `intermediate_size`, the first and last layer, one on either
PP2 stage; megatron keys such a model per layer), and a tied variant with true and every layer
MoE; norms moved off 1. The same checks as every family (tests/families/_support.py): config and refusals,
the tensors megatron builds are the mapping's, bit-identical round trip, logits within 11x their
fp32 rounding at 1 rank, PP2xEP2, TP2xEP2+SP and ETP2 (grouped), and LoRA on every linear
kind - the shared expert's and the dense layers' MLP included - trained at TP2xEP2+SP as at one rank,
exported to PEFT (logits; the dense MLP as target_modules `mlp.gate_proj` ...), imported and
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
              mlp_only_layers=[0, 3], architectures=["Qwen2MoeForCausalLM"],
              model_type="qwen2_moe")
VARIANTS = {"hf": {}, "tied": dict(tie_word_embeddings=True, norm_topk_prob=True,
                                   mlp_only_layers=[])}


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
    assert (s.moe_layer_pattern, s.dense_ffn_hidden_size) == ((0, 1, 1, 0), 80)
    stepped = model_info(dict(CONFIG, mlp_only_layers=[3], decoder_sparse_step=2)).shape
    assert stepped.moe_layer_pattern == (0, 1, 0, 0)  # (l + 1) % 2 == 0 and l not listed
    assert model_info(dict(CONFIG, mlp_only_layers=None)).shape.moe_layer_pattern is None


@pytest.mark.parametrize("change,message", [
    (dict(mlp_only_layers=[0, "1"]), "field mlp_only_layers=[0, '1']: '1' is not a layer index"),
    (dict(mlp_only_layers=[0, 1, 2, 3]), "every layer is dense (no MoE layer)"),
    (dict(intermediate_size=None),  # read only with dense layers
     "field 'intermediate_size' must be a positive integer, got null"),
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


# ---- LoRA, the shared expert's included ----

TARGETS = ["linear_qkv", "linear_proj", "router", "linear_fc1", "linear_fc2", "embedding",
           "output_layer"]


@pytest.fixture(scope="module")
def trained(qwen2):
    # TP2xEP2+SP: the shared expert's adapters sharded over TP and replicated over EP (PP with
    # dense layers on each stage is test_qwen3_moe's PP2xEP2 run)
    return F.train_and_export(qwen2, qwen2["hf"], TARGETS, layouts=(F.TP2_EP2_SP,))


def test_training_at_tp2_ep2_sp_is_the_one_rank_run(trained):
    adapter = F.check_training_parity(trained, "run_tp")
    # per-layer keys (dense layers 0 and 3): the shared expert's adapters on the MoE layers,
    # the dense MLP's on the dense ones
    shared = sorted(k for k in adapter if "shared_experts" in k)
    assert shared == [f"decoder.layers.{l}.mlp.shared_experts.linear_fc{i}.lora_{ab}"
                      for l in (1, 2) for i in (1, 2) for ab in "AB"], shared
    dense = sorted(k for k in adapter if ".mlp.linear_fc" in k)
    assert dense == [f"decoder.layers.{l}.mlp.linear_fc{i}.lora_{ab}"
                     for l in (0, 3) for i in (1, 2) for ab in "AB"], dense
    assert all(adapter[k].abs().max() > 0 for k in shared + dense)


def test_peft_export_loads_in_transformers_with_our_logits(trained):
    config = F.check_peft_logits(trained)
    assert config["auto_mapping"]["base_model_class"] == "Qwen2MoeForCausalLM"
    # transformers 5 keeps Qwen2-MoE's experts fused and PEFT does not map per-expert names for
    # it: router and routed experts are parameters, the shared expert named apart from them
    assert config["target_parameters"] == ["mlp.gate.weight", "mlp.experts.gate_up_proj",
                                           "mlp.experts.down_proj"]
    # the dense layers' MLP named with its parent, apart from the shared expert's
    assert sorted(config["target_modules"]) == sorted(
        ["embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "shared_expert.gate_proj",
         "shared_expert.up_proj", "shared_expert.down_proj", "mlp.gate_proj", "mlp.up_proj",
         "mlp.down_proj", "lm_head"])
    assert config["use_rslora"] is True and config["lora_dropout"] == 0.0


def test_import_of_the_export_is_bit_identical(trained, tmp_path):
    F.check_import_is_bit_identical(trained, str(tmp_path / "back"))


def test_greedy_generate_with_the_adapter_is_transformers_peft(trained, tmp_path):
    F.check_generate(trained, str(tmp_path))


def test_shared_expert_rank_pattern_is_checked_apart_from_the_routed_experts():
    from megatron_lora.lora.model import LoraConfig
    from megatron_lora.lora.sizes import model_problems

    info = model_info(CONFIG)
    ok = LoraConfig(r=4, target_modules=["linear_fc1"], rank_pattern={"shared_experts": 2})
    assert model_problems(ok, info) == []  # one stack each: routed at 4, shared at 2
    bad = LoraConfig(r=4, target_modules=["linear_fc1"],
                     rank_pattern={r"layers\.1\.mlp\.shared_experts": 2})
    (msg,) = model_problems(bad, info)
    assert "gives the shared-expert linear_fc1 adapters different ranks [2, 4]" in msg
    big = LoraConfig(r=4, target_modules=["linear_fc2"], rank_pattern={"shared_experts": 48})
    (msg,) = model_problems(big, info)
    assert "exceeds min(in_features, out_features) = 40" in msg and "shared expert" in msg


# ---- PEFT's own DoRA / prefix-tuning adapters on this family ----

@pytest.mark.parametrize("kind", ["dora"])
def test_peft_s_own_adapter_imports_and_gives_peft_s_logits(kind, qwen2, tmp_path):
    """q/k/v biases (DoRA's weight norm is over the weight alone; the bias is added after scaling)."""
    from tests.families._peft_made import check_peft_save_gives_peft_logits

    check_peft_save_gives_peft_logits(qwen2, kind, str(tmp_path))
