"""OLMoE against transformers 5.24's own OlmoeForCausalLM and PEFT 0.21.

A tiny random model made by transformers in the test (8 heads and 4 key/value heads of 8
channels, so TP4 splits both; the query and key norms over the whole projection, [64] and [32],
and the layer norms moved off 1; norm_topk_prob false, and a tied variant with true):

- config.json reads into the right sizes (full-width query/key norms), and what megatron-core
  cannot reproduce is refused naming the field;
- convert -> megatron -> HF is bit-identical; the converted checkpoint and the HF folders give
  transformers' logits within 11x their fp32 rounding at 1 rank, PP2xEP2, TP2xEP2+SP, ETP2
  (grouped experts) and TP4+SP (each rank a quarter of each norm, the mean of squares summed
  over TP);
- `train` with LoRA on every linear kind (attention, router, experts, embedding, output layer;
  dropout 0.1, rsLoRA) at PP2xEP2 gives the one-rank run's losses and adapter, and at TP2+SP
  its losses and attention, embedding and output adapters; the PEFT export of PP2xEP2 loads in
  transformers + PEFT with the logits of `logits --adapter` at TP2+SP (11x its fp32 rounding);
  import of the export is bit-identical; greedy `generate --adapter` gives transformers +
  PEFT's tokens.
"""

import json
import os

import pytest
import torch

from megatron_lora.families import ModelConfigError, model_info
from megatron_lora.families.olmoe import OLMOE
from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing import compare
from tests.families import _support as F

CONFIG = dict(vocab_size=250, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
              max_position_embeddings=128, initializer_range=0.1, norm_topk_prob=False,
              rms_norm_eps=1e-5, architectures=["OlmoeForCausalLM"], model_type="olmoe")
VARIANTS = {"hf": {}, "tied": dict(tie_word_embeddings=True, norm_topk_prob=True)}
TARGETS = ["linear_qkv", "linear_proj", "router", "linear_fc1", "linear_fc2", "embedding",
           "output_layer"]


def make(directory: str, seed: int = 0, **overrides) -> None:
    import torch
    from transformers import AutoModelForCausalLM, OlmoeConfig

    torch.manual_seed(seed)
    cfg = {k: v for k, v in dict(CONFIG, **overrides).items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(OlmoeConfig(**cfg)).float()
    F.perturb_norms(model)
    model.save_pretrained(directory, max_shard_size="200KB")


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    return F.convert_and_reference(str(tmp_path_factory.mktemp("olmoe")), make, VARIANTS)


# ---- config.json ----

def test_config_gives_the_sizes_megatron_builds():
    info = model_info(CONFIG)
    s = info.shape
    assert info.family is OLMOE and info.head_dim == 8 and s.kv_channels is None
    assert s.qk_layernorm and s.qk_norm_full_width and s.qk_norm_widths() == (64, 32)
    assert s.moe_router_pre_softmax  # norm_topk_prob false: no renormalising
    assert (s.ffn_hidden_size, s.num_experts, s.moe_router_topk) == (48, 4, 2)
    assert (s.num_attention_heads, s.num_query_groups) == (8, 4)
    assert s.vocab_size == 256 and info.vocab_size == 250 and s.rotary_base == 10000.0
    assert not model_info(dict(CONFIG, norm_topk_prob=True)).shape.moe_router_pre_softmax
    saved = {k: v for k, v in CONFIG.items() if k != "num_experts"}
    assert model_info(dict(saved, num_local_experts=4)).shape.num_experts == 4
    assert model_info(dict(CONFIG, head_dim=8, clip_qkv=None)).head_dim == 8


@pytest.mark.parametrize("change,message", [
    (dict(clip_qkv=8.0), "field clip_qkv=8.0: clamping"),
    (dict(attention_bias=True), "field attention_bias=true"),
    (dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4)),
     "field rope_type='linear': only unscaled"),
    (dict(head_dim=16), "field head_dim=16 differs from hidden_size/num_attention_heads=64/8"),
    (dict(sliding_window=64), "field sliding_window=64 is smaller"),
    (dict(hidden_act="gelu"), "field hidden_act='gelu': only 'silu'"),
    (dict(norm_topk_prob="yes"), "field 'norm_topk_prob' must be true or false"),
    (dict(num_experts=0), "field 'num_experts' must be a positive integer"),
    (dict(num_key_value_heads=3), "num_attention_heads=8 is not a multiple of num_query_groups=3"),
])
def test_what_megatron_cannot_reproduce_is_refused_naming_the_field(change, message):
    with pytest.raises(ModelConfigError) as err:
        model_info(dict(CONFIG, **change), source="/m/config.json")
    assert str(err.value).startswith("/m/config.json: ") and message in str(err.value), err.value


# ---- conversion and logits ----

def test_round_trip_is_bit_identical(olmoe, tmp_path):
    from megatron_lora.convert.mcore_to_hf import mcore_to_hf
    from tests.convert.test_roundtrip import assert_bit_identical, read_hf_tensors

    out = str(tmp_path / "hf_out")
    mcore_to_hf(olmoe["mcore"], out, max_shard_bytes=200_000, progress=False)
    original = read_hf_tensors(olmoe["hf"])
    assert original["model.layers.1.self_attn.q_norm.weight"].shape == (64,)  # the whole width
    assert original["model.layers.1.self_attn.k_norm.weight"].shape == (32,)
    assert_bit_identical(original, read_hf_tensors(out))
    assert json.load(open(os.path.join(out, "config.json")))["num_key_value_heads"] == 4


def test_the_checks_before_build_know_the_full_width_norms(olmoe):
    from megatron_lora.convert.checks import checkpoint_problems, parameter_bytes_per_rank
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.mapping import hf_shapes

    info = open_hf(olmoe["hf"])[0]
    assert checkpoint_problems(info, olmoe["mcore"], "config.json") == []
    hf = sum(torch.Size(s).numel() for s in hf_shapes(info).values())
    padding = 2 * (256 - 250) * 64  # padded rows of the embedding and output layer
    assert parameter_bytes_per_rank(info, ParallelLayout(), torch.float32) == 4 * (hf + padding)
    # TP2: half of each norm (and of attention, vocabulary, experts) per rank
    assert parameter_bytes_per_rank(info, ParallelLayout(tp=2), torch.float32) < 4 * (hf + padding)


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2, sp=True), ParallelLayout(pp=2)],
                         ids=["TP2+SP", "PP2"])
def test_megatron_builds_the_tensors_of_the_mapping(layout, olmoe):
    F.structure_matches_megatron(paths=olmoe, name="hf", layout=layout)


@pytest.mark.parametrize("layout,grouped,world_size", [
    pytest.param(ParallelLayout(), False, 1, id="1rank"),
    pytest.param(ParallelLayout(pp=2, ep=2), False, 4, id="PP2xEP2"),
    pytest.param(ParallelLayout(tp=2, ep=2, sp=True), False, 4, id="TP2xEP2+SP"),
    pytest.param(ParallelLayout(ep=1, etp=2), True, 2, id="ETP2-grouped"),
    pytest.param(ParallelLayout(tp=4, sp=True), False, 4, id="TP4+SP"),
])
def test_logits_match_transformers(layout, grouped, world_size, olmoe):
    F.logits_at_layout(layout=layout, grouped=grouped, world_size=world_size, paths=olmoe,
                       variants=list(VARIANTS))


# ---- LoRA: train at two layouts, export to PEFT, import, generate ----

@pytest.fixture(scope="module")
def trained(olmoe):
    return F.train_and_export(olmoe, olmoe["hf"], TARGETS)


def test_training_at_pp2_ep2_is_the_one_rank_run(trained):
    adapter = F.check_training_parity(trained)
    kinds = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in adapter}
    assert kinds == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "word_embeddings",
                     "output_layer", "lora"}, kinds  # "lora": the router's (mlp.router.lora.)


def test_training_at_tp2_sp_is_the_one_rank_run(trained):
    """The same run at TP2+SP: the norms' backward sums the mean-of-squares gradient over TP,
    which LoRA on linear_qkv (and everything before it) trains through. Compared: the losses and
    every adapter, the experts' and router's included (their TP-split sums move Adam's steps of
    near-cancelling gradients: compare.assert_adam_trained_close allows for those)."""
    from megatron_lora.training.logging import read_metrics

    out = os.path.join(trained["root"], "run_tp2")
    F.run("train", "--load-hf", trained["hf"], "--tokenizer", trained["tok"], "--data-path",
          os.path.join(trained["root"], "text.jsonl"), "--seq-length", "16",
          "--global-batch-size", "4", "--train-iters", str(F.ITERS), "--lr", str(F.LR),
          "--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1", "--lora-use-rslora",
          "--lora-target-modules", *TARGETS, "--seed", "3", "--log-interval", "1",
          "--tensor-model-parallel-size", "2", "--sequence-parallel", "--save", out, nproc=2)
    losses = [[r["lm loss"] for r in read_metrics(os.path.join(d, "metrics.jsonl"))
               if "lm loss" in r] for d in (trained["run1"], out)]
    F.check_losses(trained, losses[1], losses[0], "TP2+SP vs one rank")
    one, two = F.adapter_tensors(trained["run1"]), F.adapter_tensors(out)
    assert sorted(one) == sorted(two)
    assert any(k.startswith("decoder.layers.self_attention.linear_qkv.") for k in one)
    assert any(".experts." in k for k in one), sorted(one)
    # as _support.check_training_parity (Adam's bound on every element, the tight bound on all
    # but rare single elements whose gradient cancels)
    compare.assert_adam_trained_close(two, one, lrs=[F.LR] * F.ITERS,
                                      tight=compare.adam_tight_bound([F.LR] * F.ITERS, F.CHAIN),
                                      what="TP2+SP vs one rank")


def test_peft_export_loads_in_transformers_with_our_logits(trained):
    config = F.check_peft_logits(trained)
    assert config["auto_mapping"]["base_model_class"] == "OlmoeForCausalLM"
    assert sorted(config["target_modules"]) == sorted(
        ["embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate", "gate_proj", "up_proj",
         "down_proj", "lm_head"])
    # rsLoRA written as plain LoRA with alpha x sqrt(r): PEFT's fused gate_up doubles r and alpha
    assert config["use_rslora"] is False and config["lora_alpha"] == 16.0 and config["r"] == 4


def test_import_of_the_export_is_bit_identical(trained, tmp_path):
    F.check_import_is_bit_identical(trained, str(tmp_path / "back"))


def test_greedy_generate_with_the_adapter_is_transformers_peft(trained, tmp_path):
    F.check_generate(trained, str(tmp_path))


# ---- PEFT's own DoRA / prefix-tuning adapters on this family ----

@pytest.mark.parametrize("kind", ["prefix"])
def test_peft_s_own_adapter_imports_and_gives_peft_s_logits(kind, olmoe, tmp_path):
    """q/k norms over the whole projection width (the prefix keys bypass them)."""
    from tests.families._peft_made import check_peft_save_gives_peft_logits

    check_peft_save_gives_peft_logits(olmoe, kind, str(tmp_path))
