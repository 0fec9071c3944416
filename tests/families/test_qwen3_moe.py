"""Qwen3-MoE against transformers 5.24's own Qwen3MoeForCausalLM and PEFT 0.21.

A tiny random model made by transformers in the test (head_dim 24 with hidden 64 and 4 heads, so
q is wider than the hidden size; q/k norm weights and layer norms moved off 1; norm_topk_prob
false; `decoder_sparse_step` 2, so layers 0 and 2 are dense MLPs of `intermediate_size` between
the MoE layers 1 and 3, one of each on either PP2 stage, which megatron-core keys per layer;
and a tied variant with true, every layer MoE):

- config.json reads into the right sizes, and what megatron-core cannot reproduce is refused
  naming the field;
- convert -> megatron -> HF is bit-identical; the converted checkpoint and the HF folders give
  transformers' logits within 11x their fp32 rounding at 1 rank, PP2xEP2, TP2xEP2+SP and ETP2
  (grouped experts);
- `train` with LoRA on every linear kind (attention, router, experts, the dense layers' MLP,
  embedding, output layer; dropout 0.1, rsLoRA) at PP2xEP2 gives the one-rank run's losses and
  adapter; its PEFT export (the dense MLP as target_parameters: PEFT would move module targets
  named gate_proj / up_proj / down_proj onto the fused experts) loads in transformers + PEFT with
  the logits of `logits --adapter` at TP2+SP (11x its fp32 rounding); import of the export is
  bit-identical; greedy `generate --adapter` gives transformers + PEFT's tokens.
"""

import json
import os

import pytest

from megatron_lora.families import ModelConfigError, model_info
from megatron_lora.families.qwen3_moe import QWEN3_MOE
from megatron_lora.runtime import ParallelLayout
from tests.families import _support as F

CONFIG = dict(vocab_size=250, hidden_size=64, intermediate_size=80, moe_intermediate_size=48,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
              num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
              initializer_range=0.1, norm_topk_prob=False, rms_norm_eps=1e-6,
              decoder_sparse_step=2, architectures=["Qwen3MoeForCausalLM"],
              model_type="qwen3_moe")
VARIANTS = {"hf": {}, "tied": dict(tie_word_embeddings=True, norm_topk_prob=True,
                                   decoder_sparse_step=1)}
TARGETS = ["linear_qkv", "linear_proj", "router", "linear_fc1", "linear_fc2", "embedding",
           "output_layer"]


def make(directory: str, seed: int = 0, **overrides) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    cfg = {k: v for k, v in dict(CONFIG, **overrides).items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**cfg)).float()
    F.perturb_norms(model)
    model.save_pretrained(directory, max_shard_size="200KB")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return F.convert_and_reference(str(tmp_path_factory.mktemp("qwen3_moe")), make, VARIANTS)


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
    # transformers' rule: layer l is sparse iff l not in mlp_only_layers and (l + 1) % step == 0
    assert (s.moe_layer_pattern, s.dense_ffn_hidden_size) == ((0, 1, 0, 1), 80)
    listed = model_info(dict(CONFIG, decoder_sparse_step=1, mlp_only_layers=[1])).shape
    assert (listed.moe_layer_pattern, listed.dense_ffn_hidden_size) == ((1, 0, 1, 1), 80)
    homogeneous = model_info(dict(CONFIG, decoder_sparse_step=1)).shape
    assert homogeneous.moe_layer_pattern is None and not homogeneous.per_layer_keys


def test_dense_layers_are_sized_apart_from_the_experts():
    from megatron_lora.lora.model import LoraConfig
    from megatron_lora.lora.sizes import model_problems

    info = model_info(CONFIG)
    bad = LoraConfig(r=4, target_modules=["linear_fc1"],
                     rank_pattern={r"layers\.0\.mlp\.linear_fc1": 2})
    (msg,) = model_problems(bad, info)
    assert "gives the dense-MLP linear_fc1 adapters different ranks [2, 4]" in msg, msg
    # the dense MLP (fc2 in: 80) allows a rank the experts (48) do not
    (msg,) = model_problems(LoraConfig(r=56, target_modules=["linear_fc2"]), info)
    assert "exceeds min(in_features, out_features) = 48 of linear_fc2" in msg, msg
    no_router = LoraConfig(r=4, target_modules=["router"], rank_pattern={r"layers\.0\.": 2})
    (msg,) = model_problems(no_router, info)  # layer 0 is dense: it has no router
    assert "matches no adapter" in msg and "e.g. 'decoder.layers.1.mlp.router'" in msg, msg


@pytest.mark.parametrize("change,message", [
    (dict(mlp_only_layers=[4]), "field mlp_only_layers=[4]: 4 is not a layer index 0..3"),
    (dict(decoder_sparse_step=5), "every layer is dense (no MoE layer)"),
    (dict(decoder_sparse_step=0), "field 'decoder_sparse_step' must be a positive integer"),
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


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2, sp=True), ParallelLayout(pp=2)],
                         ids=["TP2+SP", "PP2"])
def test_megatron_builds_the_tensors_of_the_mapping(layout, qwen3):
    F.structure_matches_megatron(paths=qwen3, name="hf", layout=layout)


@pytest.mark.parametrize("layout,grouped,world_size", [
    pytest.param(ParallelLayout(), False, 1, id="1rank"),
    pytest.param(ParallelLayout(pp=2, ep=2), False, 4, id="PP2xEP2"),
    pytest.param(ParallelLayout(tp=2, ep=2, sp=True), False, 4, id="TP2xEP2+SP"),
    pytest.param(ParallelLayout(ep=1, etp=2), True, 2, id="ETP2-grouped"),
])
def test_logits_match_transformers(layout, grouped, world_size, qwen3):
    F.logits_at_layout(layout=layout, grouped=grouped, world_size=world_size, paths=qwen3,
                       variants=list(VARIANTS))


# ---- LoRA: train at two layouts, export to PEFT, import, generate ----

@pytest.fixture(scope="module")
def trained(qwen3):
    return F.train_and_export(qwen3, qwen3["hf"], TARGETS)


def test_training_at_pp2_ep2_is_the_one_rank_run(trained):
    adapter = F.check_training_parity(trained)
    kinds = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in adapter}
    assert kinds == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "word_embeddings",
                     "output_layer", "lora"}, kinds  # "lora": the router's (mlp.router.lora.)
    # megatron keys a model with dense layers per layer: the dense MLP's adapters on layers 0
    # and 2, the experts' and the router's on 1 and 3, trained
    dense = sorted(k for k in adapter if ".mlp.linear_fc" in k)
    assert dense == [f"decoder.layers.{l}.mlp.linear_fc{i}.lora_{ab}" for l in (0, 2)
                     for i in (1, 2) for ab in "AB"], dense
    assert all(adapter[k].abs().max() > 0 for k in dense)
    experts = {k.split(".mlp.")[0] for k in adapter if ".mlp.experts." in k or ".router." in k}
    assert experts == {"decoder.layers.1", "decoder.layers.3"}, experts


def test_an_adapter_for_another_layer_mix_is_refused_naming_the_layers(trained):
    from megatron_lora.convert.errors import ConversionError
    from megatron_lora.export.adapter_ckpt import AdapterCheckpoint

    other = model_info(dict(CONFIG, decoder_sparse_step=1, mlp_only_layers=[1]))  # (1, 0, 1, 1)
    with pytest.raises(ConversionError, match=r"mlp\.router\.lora\.lora_A is stored for layers "
                                              r"\[1, 3\], but the model has it on layers "
                                              r"\[0, 2, 3\]"):
        AdapterCheckpoint(trained["run4"], other)


def test_peft_export_loads_in_transformers_with_our_logits(trained):
    config = F.check_peft_logits(trained)
    assert config["auto_mapping"]["base_model_class"] == "Qwen3MoeForCausalLM"
    assert sorted(config["target_modules"]) == sorted(
        ["embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate", "gate_proj", "up_proj",
         "down_proj", "lm_head"])
    # PEFT moves target_modules gate_proj / up_proj / down_proj onto the fused experts (the dense
    # layers' nn.Linear adapters would load as nothing): the dense MLP's weights are parameters
    assert config["target_parameters"] == ["mlp.gate_proj.weight", "mlp.up_proj.weight",
                                           "mlp.down_proj.weight"]
    # rsLoRA written as plain LoRA with alpha x sqrt(r): PEFT's fused gate_up doubles r and alpha
    assert config["use_rslora"] is False and config["lora_alpha"] == 16.0 and config["r"] == 4


def test_import_of_the_export_is_bit_identical(trained, tmp_path):
    F.check_import_is_bit_identical(trained, str(tmp_path / "back"))


def test_greedy_generate_with_the_adapter_is_transformers_peft(trained, tmp_path):
    F.check_generate(trained, str(tmp_path))


def test_merged_export_is_the_adapted_model(trained, tmp_path):
    """export hf --merge folds every adapter, the dense layers' MLP included, into the weights:
    transformers' logits of the merged folder are those of `logits --adapter`."""
    import torch
    from safetensors.torch import load_file

    from megatron_lora.export.merged import export_merged_hf

    out = str(tmp_path / "merged")
    export_merged_hf(trained["mcore"], trained["run4"], out, progress=False)
    tokens = torch.tensor(json.load(open(trained["tokens"])))
    # bound: transformers' own fp32 rounding on the merged folder (compare.reference_bound);
    # the merge's one rounding per weight is of the size of one more matmul's, within K
    F.S.assert_near_reference(load_file(trained["logits"])["logits"],
                              F.S.in_both(F.hf_logits, out, tokens),
                              "logits --adapter vs transformers on the merged export")


# ---- PEFT's own DoRA / prefix-tuning adapters on this family ----

@pytest.mark.parametrize("kind", ["dora", "prefix"])
def test_peft_s_own_adapter_imports_and_gives_peft_s_logits(kind, qwen3, tmp_path):
    """Per-head q/k norms (the prefix keys bypass them, as in transformers' cache), q wider
    than the hidden size, dense layers between the MoE layers."""
    from tests.families._peft_made import check_peft_save_gives_peft_logits

    check_peft_save_gives_peft_logits(qwen3, kind, str(tmp_path))
