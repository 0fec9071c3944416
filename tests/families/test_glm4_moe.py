"""GLM-4.5 (glm4_moe) against transformers 5.24's own Glm4MoeForCausalLM.

A tiny random model made by transformers in the test: sigmoid routing over 8 experts in 4 groups
of which 2 are kept (top-4, so megatron's group score, the sum of a group's top 4 / 2 scores, is
transformers' top-2 sum), a non-zero `e_score_correction_bias` that changes which experts are
chosen, `routed_scaling_factor` 1.5, a shared expert, layer 0 dense (`first_k_dense_replace` 1),
RoPE on half of each head (`partial_rotary_factor` 0.5), q/k/v biases; a variant with per-head
q/k norms, no groups, every layer MoE. The checkpoint also holds a multi-token-prediction layer
(`model.layers.4.*`, `num_nextn_predict_layers` 1), which the model does not build and
conversion carries unchanged. Checks: config and refusals, the tensors megatron builds are the
mapping's, bit-identical round trip (the MTP layer included), logits within 11x their fp32
rounding at 1 rank, PP2xEP2, TP2xEP2+SP and ETP2 (grouped), the expert bias unchanged by LoRA
training at EP2, and
LoRA on every linear kind - the dense layer's MLP and the shared expert's included - trained at
PP2xEP2 as at one rank, exported to PEFT (logits; dense MLP and shared expert as
target_parameters), imported, generated with, and merged (with the MTP layer written back).
"""

import json
import os

import pytest
import torch

from megatron_lora.families import ModelConfigError, model_info
from megatron_lora.families.glm4_moe import GLM4_MOE
from megatron_lora.runtime import ParallelLayout
from tests.families import _support as F
from tests.harness import multirank

CONFIG = dict(vocab_size=250, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
              n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
              norm_topk_prob=True, attention_bias=True, partial_rotary_factor=0.5,
              max_position_embeddings=128, initializer_range=0.1, rms_norm_eps=1e-5,
              num_nextn_predict_layers=1, architectures=["Glm4MoeForCausalLM"],
              model_type="glm4_moe")
VARIANTS = {"hf": {}, "qknorm": dict(use_qk_norm=True, n_group=1, topk_group=1,
                                     first_k_dense_replace=0, routed_scaling_factor=1.0)}
MTP = {"model.layers.4.eh_proj.weight": (64, 128), "model.layers.4.enorm.weight": (64,),
       "model.layers.4.self_attn.q_proj.weight": (64, 64)}


def make(directory: str, seed: int = 0, **overrides) -> None:
    from transformers import AutoModelForCausalLM, Glm4MoeConfig

    torch.manual_seed(seed)
    cfg = {k: v for k, v in dict(CONFIG, **overrides).items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(Glm4MoeConfig(**cfg)).float()
    F.perturb_norms(model)
    with torch.no_grad():  # zero biases would hide a lost bias or a bias applied to the weights
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    model.save_pretrained(directory, max_shard_size="200KB")
    # the multi-token-prediction layer the published checkpoints hold (transformers does not
    # build it): one more shard, listed in the index
    F.add_extra_shard(directory, MTP)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return F.convert_and_reference(str(tmp_path_factory.mktemp("glm4_moe")), make, VARIANTS)


def test_config_gives_the_sizes_megatron_builds():
    info = model_info(CONFIG)
    s = info.shape
    assert info.family is GLM4_MOE and info.head_dim == 16 and not s.qk_layernorm
    assert s.add_qkv_bias and not s.add_bias_linear and s.rotary_percent == 0.5
    assert (s.ffn_hidden_size, s.num_experts, s.moe_router_topk) == (32, 8, 4)
    assert s.shared_expert_ffn_hidden_size == 32 and not s.shared_expert_gate
    assert (s.moe_layer_pattern, s.dense_ffn_hidden_size) == ((0, 1, 1, 1), 80)
    assert (s.moe_router_score_function, s.moe_router_expert_bias) == ("sigmoid", True)
    assert (s.moe_router_num_groups, s.moe_router_group_topk) == (4, 2)
    assert s.moe_router_topk_scaling_factor == 1.5 and not s.moe_router_pre_softmax
    two = model_info(dict(CONFIG, n_shared_experts=2, first_k_dense_replace=0,
                          use_qk_norm=True, topk_group=4)).shape
    assert two.shared_expert_ffn_hidden_size == 64 and two.moe_layer_pattern is None
    assert two.qk_layernorm and two.moe_router_num_groups is None  # every group kept: plain top-k
    nested = dict(CONFIG, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                           "partial_rotary_factor": 0.25})
    assert model_info(nested).shape.rotary_percent == 0.25
    one = model_info(dict(CONFIG, num_experts_per_tok=1, norm_topk_prob=False, n_group=1,
                         topk_group=1))
    assert one.shape.moe_router_topk == 1


def test_the_router_config_megatron_gets_freezes_the_expert_bias():
    from megatron_lora.models.gpt import transformer_config

    c = transformer_config(model_info(CONFIG).shape, ParallelLayout())
    assert (c.moe_router_score_function, c.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert c.moe_router_bias_update_rate == 0.0
    assert (c.moe_router_num_groups, c.moe_router_group_topk) == (4, 2)
    assert c.moe_router_topk_scaling_factor == 1.5 and c.moe_layer_freq == [0, 1, 1, 1]


@pytest.mark.parametrize("change,message", [
    (dict(norm_topk_prob=False), "field norm_topk_prob=false with num_experts_per_tok=4"),
    (dict(num_experts_per_tok=1, n_group=1, topk_group=1),
     "field norm_topk_prob=true with num_experts_per_tok=1"),
    (dict(topk_group=1), "field topk_group=1 (n_group=4, num_experts_per_tok=4)"),
    # top-k / topk_group = 1: megatron scores a group by its best expert, transformers by its
    # top 2 (sigmoid group routing; DeepSeek-V2's group_limited_greedy at 1 is accepted)
    (dict(num_experts_per_tok=2), "field topk_group=2 (n_group=4, num_experts_per_tok=2)"),
    (dict(num_experts_per_tok=1, norm_topk_prob=False, topk_group=1),
     "field topk_group=1 (n_group=4, num_experts_per_tok=1)"),
    (dict(num_experts_per_tok=3, topk_group=1),  # 3: a group by its top 3
     "field topk_group=1 (n_group=4, num_experts_per_tok=3)"),
    (dict(n_group=8), "field topk_group=2 (n_group=8, num_experts_per_tok=4)"),  # 1 per group
    (dict(n_group=3), "field 'n_group' must divide the 8 experts"),
    (dict(topk_group=5), "field 'topk_group' must be at most n_group=4"),
    (dict(partial_rotary_factor=0.1), "field 'partial_rotary_factor' must give an even rotary"),
    (dict(first_k_dense_replace=5), "field 'first_k_dense_replace' must be 0..4"),
    (dict(first_k_dense_replace=4), "every layer is dense (no MoE layer)"),
    (dict(n_shared_experts=0), "field 'n_shared_experts' must be a positive integer, got 0"),
    (dict(attention_dropout=0.1), "field attention_dropout=0.1: only 0"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "only unscaled ('default') RoPE"),
    (dict(hidden_act="gelu"), "field hidden_act='gelu'"),
])
def test_what_megatron_cannot_reproduce_is_refused_naming_the_field(change, message):
    with pytest.raises(ModelConfigError) as err:
        model_info(dict(CONFIG, **change), source="/m/config.json")
    assert str(err.value).startswith("/m/config.json: ") and message in str(err.value), err.value


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2, sp=True), ParallelLayout(pp=2)],
                         ids=["TP2+SP", "PP2"])
def test_megatron_builds_the_tensors_of_the_mapping(layout, glm):
    F.structure_matches_megatron(paths=glm, name="hf", layout=layout)


def test_round_trip_is_bit_identical_the_mtp_layer_carried_unchanged(glm, tmp_path, capfd):
    """The MTP layer is not built (said once) but kept: hf_carried.safetensors in the megatron
    folder, model-carried.safetensors (in the index) in the HF folder, bit for bit."""
    from megatron_lora.convert.hf_to_mcore import hf_to_mcore
    from megatron_lora.convert.mcore_to_hf import mcore_to_hf
    from tests.convert.test_roundtrip import assert_bit_identical, read_hf_tensors

    capfd.readouterr()
    mcore = str(tmp_path / "mcore")
    hf_to_mcore(glm["hf"], mcore, progress=False)
    err = capfd.readouterr().err
    assert err.count("skipping the 3 tensors of layer(s) 4..4 (num_nextn_predict_layers=1)") == 1
    out = str(tmp_path / "hf_out")
    mcore_to_hf(mcore, out, max_shard_bytes=200_000, progress=False)
    original = read_hf_tensors(glm["hf"])
    assert sorted(MTP) == sorted(k for k in original if k.startswith("model.layers.4."))
    assert original["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0
    assert any(k.endswith("mlp.shared_experts.gate_proj.weight") for k in original)
    assert any(k.endswith("self_attn.q_proj.bias") for k in original)
    assert_bit_identical(original, read_hf_tensors(out))
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert {index["weight_map"][k] for k in MTP} == {"model-carried.safetensors"}
    assert json.load(open(os.path.join(out, "config.json")))["n_group"] == 4


def test_a_carried_file_out_of_the_folder_or_of_other_layers_is_refused(glm, tmp_path):
    import shutil

    from safetensors.torch import save_file

    from megatron_lora.convert.errors import ConversionError
    from megatron_lora.convert.mcore_to_hf import mcore_to_hf

    mcore = str(tmp_path / "mcore")
    shutil.copytree(glm["mcore"], mcore)
    carried = os.path.join(mcore, "hf_carried.safetensors")
    save_file({"model.layers.3.mlp.gate.weight": torch.zeros(8, 64)}, carried)
    with pytest.raises(ConversionError, match=r"hf_carried.safetensors: tensor 'model.layers.3."
                                              r"mlp.gate.weight' is not in a layer config.json "
                                              r"counts after the decoder \(num_nextn_predict_"
                                              r"layers=1\)"):
        mcore_to_hf(mcore, str(tmp_path / "a"), progress=False)
    os.remove(carried)
    os.symlink(os.path.join(glm["hf"], "mtp.safetensors"), carried)
    with pytest.raises(ConversionError, match="outside the folder"):
        mcore_to_hf(mcore, str(tmp_path / "b"), progress=False)
    assert not os.path.exists(str(tmp_path / "a")) and not os.path.exists(str(tmp_path / "b"))


@pytest.mark.parametrize("layout,world_size", [
    pytest.param(ParallelLayout(), 1, id="1rank"),
    pytest.param(ParallelLayout(pp=2, ep=2), 4, id="PP2xEP2"),
    pytest.param(ParallelLayout(tp=2, ep=2, sp=True), 4, id="TP2xEP2+SP"),
])
def test_logits_match_transformers(layout, world_size, glm):
    F.logits_at_layout(layout=layout, grouped=False, world_size=world_size, paths=glm,
                       variants=list(VARIANTS))


def test_logits_match_transformers_at_etp2_with_grouped_experts(glm):
    F.logits_at_layout(layout=ParallelLayout(ep=1, etp=2), grouped=True, world_size=2, paths=glm,
                       variants=list(VARIANTS))


@multirank(world_size=2, timeout=600)
def _train_at_ep2(paths, layout=ParallelLayout(ep=2)):
    """Three LoRA steps (router adapters included) at EP2 from the converted checkpoint: every
    router's expert bias is bit-identical to the HF checkpoint's after them, while the adapters
    moved."""
    from megatron.core import parallel_state

    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_mcore
    from megatron_lora.data import PackedDataset, Sample, pack_samples
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.models.build import build_model, model_config
    from megatron_lora.training.loop import train
    from tests.training import _support as S

    info, hf, _ = open_hf(paths["hf"])
    model = build_model(info, model_config(info, layout))
    load_mcore(model, paths["mcore"])
    lora = LoraConfig(r=4, lora_alpha=8, seed=3, target_modules=["router", "linear_fc1"])
    adapters = apply_lora(model, lora, verbose=False)
    with torch.no_grad():
        for ad in adapters.values():
            ad.lora_B.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(3))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    biases = {n: b for n, b in model.named_buffers() if n.endswith("router.expert_bias")}
    assert len(biases) == 3, sorted(biases)
    rng = torch.Generator().manual_seed(0)
    rows = [Sample(torch.randint(0, 250, (S.SEQ - 1,), generator=rng).tolist(), [1] * (S.SEQ - 1))
            for _ in range(16)]
    train([model], PackedDataset(pack_samples(rows, S.SEQ, pad_id=0), seed=1),
          S.run_config(iters=3), S.optim(3), layout_name=layout.describe())
    moved = [n for n, p in model.named_parameters() if n in before and not torch.equal(p, before[n])]
    assert moved, "the adapters did not train: the check below would be vacuous"
    for name, bias in biases.items():
        layer = int(name.split("layers.")[1].split(".")[0])
        want = hf.read(f"model.layers.{layer}.mlp.gate.e_score_correction_bias", None)
        assert bias.dtype == torch.float32 and torch.equal(bias, want.float()), name
    assert parallel_state.get_expert_model_parallel_world_size() == 2


def test_expert_bias_stays_frozen_in_lora_training_at_ep2(glm):
    _train_at_ep2(paths=glm)


def test_a_bf16_checkpoint_keeps_its_fp32_correction_bias_through_the_round_trip(glm, tmp_path):
    """The published checkpoints hold bf16 weights and an fp32 e_score_correction_bias: they
    convert (not refused as mixed dtypes) and come back bit for bit, the bias still fp32."""
    import shutil

    from safetensors.torch import save_file

    from megatron_lora.convert.hf_to_mcore import hf_to_mcore
    from megatron_lora.convert.mcore_to_hf import mcore_to_hf
    from tests.convert.test_roundtrip import assert_bit_identical, read_hf_tensors

    src = str(tmp_path / "bf16")
    shutil.copytree(glm["hf"], src)
    for name in os.listdir(src):
        if name.endswith(".safetensors") and name != "mtp.safetensors":
            path = os.path.join(src, name)
            tensors = {k: v for k, v in read_hf_tensors(src).items()
                       if json.load(open(os.path.join(src, "model.safetensors.index.json")))
                       ["weight_map"][k] == name}
            save_file({k: v if k.endswith("e_score_correction_bias") else v.bfloat16()
                       for k, v in tensors.items()}, path)
    cfg = json.load(open(os.path.join(src, "config.json")))
    json.dump(dict(cfg, dtype="bfloat16"), open(os.path.join(src, "config.json"), "w"))
    hf_to_mcore(src, str(tmp_path / "mcore"), progress=False)
    mcore_to_hf(str(tmp_path / "mcore"), str(tmp_path / "out"), progress=False)
    original = read_hf_tensors(src)  # the fp32 MTP shard included, carried unchanged
    bias = original["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and original["model.norm.weight"].dtype == torch.bfloat16
    assert_bit_identical(original, read_hf_tensors(str(tmp_path / "out")))


# ---- LoRA on every linear kind: train at PP2xEP2, export to PEFT, import, generate ----

TARGETS = ["linear_qkv", "linear_proj", "router", "linear_fc1", "linear_fc2", "embedding",
           "output_layer"]


@pytest.fixture(scope="module")
def trained(glm):
    # PP2xEP2: the dense layer 0 and the MoE layer 1 on stage 0, the experts over EP
    return F.train_and_export(glm, glm["hf"], TARGETS, layouts=(F.PP2_EP2,))


def test_training_at_pp2_ep2_is_the_one_rank_run(trained):
    adapter = F.check_training_parity(trained, "run4")
    kinds = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in adapter}
    assert kinds == {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "word_embeddings",
                     "output_layer", "lora"}, kinds  # "lora": the router's (mlp.router.lora.)
    dense = sorted(k for k in adapter if ".mlp.linear_fc" in k)
    assert dense == [f"decoder.layers.0.mlp.linear_fc{i}.lora_{ab}" for i in (1, 2)
                     for ab in "AB"], dense
    shared = sorted(k for k in adapter if "shared_experts" in k)
    assert shared == [f"decoder.layers.{l}.mlp.shared_experts.linear_fc{i}.lora_{ab}"
                      for l in (1, 2, 3) for i in (1, 2) for ab in "AB"], shared
    routed = {k.split(".mlp.")[0] for k in adapter if ".mlp.experts." in k or ".router." in k}
    assert routed == {"decoder.layers.1", "decoder.layers.2", "decoder.layers.3"}, routed
    assert all(adapter[k].abs().max() > 0 for k in dense + shared)


def test_peft_export_loads_in_transformers_with_our_logits(trained):
    config = F.check_peft_logits(trained)
    assert config["auto_mapping"]["base_model_class"] == "Glm4MoeForCausalLM"
    # PEFT 0.21 maps glm4_moe's per-expert names (gate, gate_proj, up_proj, down_proj) onto
    # transformers 5's fused experts itself, and moves every target_modules entry ending in
    # gate_proj / up_proj / down_proj there: the dense layer's and the shared expert's linears
    # are named as parameters (lora.ParamWrapper on their weights), or they would load as nothing
    assert sorted(config["target_modules"]) == sorted(
        ["embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate", "gate_proj", "up_proj",
         "down_proj", "lm_head"])
    assert config["target_parameters"] == [
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
        "mlp.shared_experts.down_proj.weight"]
    assert config["use_rslora"] is False and config["lora_alpha"] == 16.0 and config["r"] == 4


def test_import_of_the_export_is_bit_identical(trained, tmp_path):
    F.check_import_is_bit_identical(trained, str(tmp_path / "back"))


def test_greedy_generate_with_the_adapter_is_transformers_peft(trained, tmp_path):
    F.check_generate(trained, str(tmp_path))


def test_merged_export_is_the_adapted_model_with_the_mtp_layer(trained, tmp_path):
    """export hf --merge folds every adapter (dense layer, shared expert, routed experts
    included) into the weights: transformers' logits of the merged folder are those of `logits
    --adapter`, and the MTP layer is written back bit for bit: a complete GLM checkpoint."""
    from safetensors.torch import load_file

    from megatron_lora.export.merged import export_merged_hf
    from tests.convert.test_roundtrip import read_hf_tensors

    out = str(tmp_path / "merged")
    export_merged_hf(trained["mcore"], trained["run4"], out, progress=False)
    tokens = torch.tensor(json.load(open(trained["tokens"])))
    # bound: transformers' own fp32 rounding on the merged folder (compare.reference_bound);
    # the merge's one rounding per weight is of the size of one more matmul's, within K
    F.S.assert_near_reference(load_file(trained["logits"])["logits"],
                              F.S.in_both(F.hf_logits, out, tokens),
                              "logits --adapter vs transformers on the merged export")
    original, merged = read_hf_tensors(trained["hf"]), read_hf_tensors(out)
    assert sorted(merged) == sorted(original)
    for name in MTP:
        assert torch.equal(merged[name], original[name]), name
