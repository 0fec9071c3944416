"""DeepSeek-V3 (deepseek_v3) and DeepSeek-V2 (deepseek_v2) against transformers 5.24's own
DeepseekV3ForCausalLM / DeepseekV2ForCausalLM.

Tiny random models made by transformers in the test, all with multi-latent attention whose
value heads (10) differ from the query/key heads (8 + 4 rope):
- "hf" (V3): q_lora_rank 24, kv_lora_rank 16, YaRN with mscale / mscale_all_dim (the softmax
  scale moves too), sigmoid routing over 8 experts in 4 groups of which 2 are kept (top-4: a
  group's top-2 sum in megatron as in transformers), a non-zero e_score_correction_bias,
  routed_scaling_factor 1.5, a shared expert, layer 0 dense, and a multi-token-prediction layer
  on disk (`model.layers.4.*`, carried unchanged);
- "v2" (V2, as V2-Lite): no q_lora_rank (one q_proj), softmax routing taken at the top-2
  without renormalising, group_limited_greedy over 4 groups keeping 2 (a group scored by its
  best expert), two shared experts;
- "rope_half" (V3): rope_interleave false (the rope rows are permuted on conversion), plain
  RoPE, no groups, every layer MoE (stacked checkpoint keys).
Checks: config and refusals, the tensors megatron builds are the mapping's, bit-identical round
trips, logits within 11x transformers' own fp32 rounding (compare.reference_bound) at 1 rank,
PP2xEP2, TP2xEP2+SP and ETP2 (grouped), and LoRA on every linear kind (every MLA projection)
trained at PP2xEP2 as at one rank, exported to PEFT, imported,
generated with and merged.
"""

import json
import os

import pytest
import torch

from megatron_lora.families import ModelConfigError, model_info
from megatron_lora.families.deepseek_v3 import DEEPSEEK_V2, DEEPSEEK_V3
from megatron_lora.runtime import ParallelLayout
from tests.families import _support as F

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 0.8}
CONFIG = dict(vocab_size=250, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
              n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.5,
              norm_topk_prob=True, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
              qk_rope_head_dim=4, v_head_dim=10, rope_parameters=YARN,
              max_position_embeddings=128, initializer_range=0.1, rms_norm_eps=1e-6,
              num_nextn_predict_layers=1, architectures=["DeepseekV3ForCausalLM"],
              model_type="deepseek_v3")
V2 = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None,
          num_experts_per_tok=2, topk_method="group_limited_greedy", norm_topk_prob=False,
          n_shared_experts=2, routed_scaling_factor=1.0, num_nextn_predict_layers=0)
VARIANTS = {"hf": {}, "v2": V2,
            "rope_half": dict(rope_interleave=False, rope_parameters=None, n_group=1,
                              topk_group=1, first_k_dense_replace=0,
                              num_nextn_predict_layers=0)}
MTP = {"model.layers.4.eh_proj.weight": (64, 128), "model.layers.4.enorm.weight": (64,),
       "model.layers.4.self_attn.kv_b_proj.weight": (72, 16)}


def make(directory: str, seed: int = 0, **overrides) -> None:
    from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

    torch.manual_seed(seed)
    cfg = {k: v for k, v in dict(CONFIG, **overrides).items() if k != "model_type"}
    config_class = DeepseekV2Config if "DeepseekV2ForCausalLM" in cfg["architectures"] else \
        DeepseekV3Config
    model = AutoModelForCausalLM.from_config(config_class(**cfg)).float()
    F.perturb_norms(model)
    with torch.no_grad():  # a zero correction bias would hide a bias lost or applied to weights
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)
    model.save_pretrained(directory, max_shard_size="200KB")
    if cfg.get("num_nextn_predict_layers"):  # the published checkpoints' MTP layer, not built
        F.add_extra_shard(directory, MTP)


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return F.convert_and_reference(str(tmp_path_factory.mktemp("deepseek")), make, VARIANTS)


def test_config_gives_the_sizes_megatron_builds():
    info = model_info(CONFIG)
    s, m = info.shape, info.shape.mla
    assert info.family is DEEPSEEK_V3 and info.head_dim == 12 and s.num_query_groups == 4
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim,
            m.v_head_dim, m.rope_interleaved) == (24, 16, 8, 4, 10, True)
    assert (s.yarn.factor, s.yarn.mscale, s.yarn.mscale_all_dim) == (4.0, 1.0, 0.8)
    assert (s.ffn_hidden_size, s.num_experts, s.moe_router_topk) == (32, 8, 4)
    assert s.shared_expert_ffn_hidden_size == 32
    assert (s.moe_layer_pattern, s.dense_ffn_hidden_size) == ((0, 1, 1, 1), 80)
    assert (s.moe_router_score_function, s.moe_router_expert_bias) == ("sigmoid", True)
    assert (s.moe_router_num_groups, s.moe_router_group_topk) == (4, 2)
    assert s.moe_router_topk_scaling_factor == 1.5 and not s.moe_router_pre_softmax
    v2 = model_info(dict(CONFIG, **V2))
    assert v2.family is DEEPSEEK_V2 and v2.shape.mla.q_lora_rank is None
    assert v2.shape.moe_router_score_function == "softmax" and v2.shape.moe_router_pre_softmax
    assert (v2.shape.moe_router_num_groups, v2.shape.moe_router_group_topk) == (4, 2)
    assert not v2.shape.moe_router_expert_bias and v2.shape.shared_expert_ffn_hidden_size == 64
    greedy = model_info(dict(CONFIG, **dict(V2, topk_method="greedy", num_experts_per_tok=6)))
    assert greedy.shape.moe_router_num_groups is None
    half = model_info(dict(CONFIG, **VARIANTS["rope_half"])).shape
    assert not half.mla.rope_interleaved and half.yarn is None and half.moe_layer_pattern is None


def test_the_config_megatron_gets_is_mla_with_transformers_yarn():
    from megatron_lora.models.gpt import transformer_config

    c = transformer_config(model_info(CONFIG).shape, ParallelLayout())
    assert c.multi_latent_attention and (c.q_lora_rank, c.kv_lora_rank) == (24, 16)
    assert (c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim) == (8, 4, 10)
    assert (c.rope_type, c.rotary_scaling_factor, c.mscale, c.mscale_all_dim) == (
        "yarn", 4.0, 1.0, 0.8)
    assert c.moe_router_bias_update_rate == 0.0 and c.moe_router_topk_scaling_factor == 1.5
    plain = dict(YARN, mscale=None, mscale_all_dim=None)  # transformers: no softmax mscale
    c = transformer_config(model_info(dict(CONFIG, rope_parameters=plain)).shape,
                           ParallelLayout())
    assert (c.mscale, c.mscale_all_dim) == (1.0, 0.0)


@pytest.mark.parametrize("change,message", [
    (dict(norm_topk_prob=False), "field norm_topk_prob=false with num_experts_per_tok=4"),
    (dict(topk_group=1), "field topk_group=1 (n_group=4, num_experts_per_tok=4)"),
    # top-k / topk_group = 1: megatron scores a group by its best expert, transformers by its
    # top 2 (sigmoid group routing; DeepSeek-V2's group_limited_greedy at 1 is accepted)
    (dict(num_experts_per_tok=2), "field topk_group=2 (n_group=4, num_experts_per_tok=2)"),
    (dict(num_experts_per_tok=1, norm_topk_prob=False, topk_group=1),
     "field topk_group=1 (n_group=4, num_experts_per_tok=1)"),
    (dict(num_experts_per_tok=3, topk_group=1),  # 3: a group by its top 3
     "field topk_group=1 (n_group=4, num_experts_per_tok=3)"),
    (dict(n_group=8), "field topk_group=2 (n_group=8, num_experts_per_tok=4)"),  # 1 per group
    (dict(scoring_func="softmax"), "field scoring_func='softmax': DeepSeek-V3 routes"),
    (dict(topk_method="greedy"), "field topk_method='greedy': DeepSeek-V3 routes"),
    (dict(V2, norm_topk_prob=True), "field norm_topk_prob=true: transformers 5.24 does not"),
    (dict(V2, num_experts_per_tok=4), "field topk_method='group_limited_greedy' with "
                                      "topk_group=2, num_experts_per_tok=4"),
    (dict(V2, topk_method="noaux_tc"), "field topk_method='noaux_tc': only 'greedy'"),
    (dict(attention_bias=True), "field attention_bias=true"),
    (dict(rope_parameters=dict(YARN, truncate=False)), "field truncate=false"),
    (dict(rope_parameters=dict(YARN, mscale=None)), "mscale_all_dim=0.8 without mscale"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "field rope_type='linear'"),
    (dict(qk_rope_head_dim=3), "field 'qk_rope_head_dim' must be even"),
    (dict(moe_layer_freq=2), "field 'moe_layer_freq' must be 1"),
    (dict(first_k_dense_replace=4), "every layer is dense (no MoE layer)"),
    (dict(hidden_act="gelu"), "field hidden_act='gelu'"),
])
def test_what_megatron_cannot_reproduce_is_refused_naming_the_field(change, message):
    with pytest.raises(ModelConfigError) as err:
        model_info(dict(CONFIG, **change), source="/m/config.json")
    assert str(err.value).startswith("/m/config.json: ") and message in str(err.value), err.value


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2, sp=True), ParallelLayout(pp=2)],
                         ids=["TP2+SP", "PP2"])
def test_megatron_builds_the_tensors_of_the_mapping(layout, ds):
    F.structure_matches_megatron(paths=ds, name="hf", layout=layout)


def test_megatron_builds_the_tensors_of_the_mapping_without_q_lora_rank(ds):
    F.structure_matches_megatron(paths=ds, name="v2", layout=ParallelLayout(tp=2))


@pytest.mark.parametrize("name", ["hf", "v2", "rope_half"])
def test_round_trip_is_bit_identical(ds, name, tmp_path):
    """Every variant converts and comes back bit for bit (the MTP layer carried, the rope rows
    of rope_interleave false permuted and permuted back)."""
    from megatron_lora.convert.hf_to_mcore import hf_to_mcore
    from megatron_lora.convert.mcore_to_hf import mcore_to_hf
    from tests.convert.test_roundtrip import assert_bit_identical, read_hf_tensors

    mcore, out = str(tmp_path / "mcore"), str(tmp_path / "out")
    hf_to_mcore(ds[name], mcore, progress=False)
    mcore_to_hf(mcore, out, max_shard_bytes=200_000, progress=False)
    original = read_hf_tensors(ds[name])
    assert any(k.endswith("kv_a_proj_with_mqa.weight") for k in original)
    assert_bit_identical(original, read_hf_tensors(out))


@pytest.mark.parametrize("layout,world_size", [
    pytest.param(ParallelLayout(), 1, id="1rank"),
    pytest.param(ParallelLayout(pp=2, ep=2), 4, id="PP2xEP2"),
    pytest.param(ParallelLayout(tp=2, ep=2, sp=True), 4, id="TP2xEP2+SP"),
])
def test_logits_match_transformers(layout, world_size, ds):
    F.logits_at_layout(layout=layout, grouped=False, world_size=world_size, paths=ds,
                       variants=list(VARIANTS))


def test_logits_match_transformers_at_etp2_with_grouped_experts(ds):
    F.logits_at_layout(layout=ParallelLayout(ep=1, etp=2), grouped=True, world_size=2, paths=ds,
                       variants=list(VARIANTS))


# ---- LoRA on every linear kind: train at PP2xEP2, export to PEFT, import, generate ----

TARGETS = ["linear_qkv", "linear_proj", "router", "linear_fc1", "linear_fc2", "embedding",
           "output_layer"]
MLA_INPUTS = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
              "linear_kv_up_proj")


@pytest.fixture(scope="module")
def trained(ds):
    # PP2xEP2: the dense layer 0 and the MoE layer 1 on stage 0, the experts over EP; TP2xEP2+SP:
    # every MLA projection split over TP (the down projections' outputs gathered back)
    return F.train_and_export(ds, ds["hf"], TARGETS, layouts=(F.PP2_EP2, F.TP2_EP2_SP))


@pytest.mark.parametrize("run", ["run4", "run_tp"], ids=["PP2xEP2", "TP2xEP2+SP"])
def test_training_is_the_one_rank_run(trained, run):
    """Every MLA projection has its adapter (linear_qkv covers them), trained as at one rank."""
    # (_support.check_training_parity: single expert elements whose gradient nearly cancels may
    # move by up to Adam's bound; at TP2xEP2+SP one of layer 3's expert 5 fc2 A moved 3.6e-4)
    adapter = F.check_training_parity(trained, run)
    attention = sorted({k.split(".self_attention.")[1].split(".lora_")[0]
                        for k in adapter if ".self_attention." in k})
    assert attention == sorted(MLA_INPUTS + ("linear_proj",)), attention
    for name in MLA_INPUTS:
        keys = [k for k in adapter if f".{name}.lora_B" in k]
        assert len(keys) == 4 and all(adapter[k].abs().max() > 0 for k in keys), name


def test_peft_export_loads_in_transformers_with_our_logits(trained):
    config = F.check_peft_logits(trained)
    assert config["auto_mapping"]["base_model_class"] == "DeepseekV3ForCausalLM"
    # PEFT's names for MLA's projections; the dense layer's and the shared expert's MLP as
    # target_parameters (PEFT 0.21 moves every target ending in gate_proj / up_proj / down_proj
    # onto the routed experts for deepseek_v3, as for glm4_moe)
    assert sorted(config["target_modules"]) == sorted(
        ["embed_tokens", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
         "gate", "gate_proj", "up_proj", "down_proj", "lm_head"])
    assert config["target_parameters"] == [
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
        "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight",
        "mlp.shared_experts.down_proj.weight"]


def test_import_of_the_export_is_bit_identical(trained, tmp_path):
    F.check_import_is_bit_identical(trained, str(tmp_path / "back"))


def test_greedy_generate_with_the_adapter_is_transformers_peft(trained, tmp_path):
    F.check_generate(trained, str(tmp_path))


def test_merged_export_is_the_adapted_model_with_the_mtp_layer(trained, tmp_path):
    """export hf --merge folds every adapter (the MLA projections included) into the weights:
    transformers' logits of the merged folder are those of `logits --adapter`; the MTP layer
    and the (frozen) score-correction biases are written back bit for bit."""
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
    kept = list(MTP) + [k for k in original if k.endswith("e_score_correction_bias")]
    for name in kept:
        assert torch.equal(merged[name], original[name]), name
    assert not torch.equal(merged["model.layers.1.self_attn.kv_b_proj.weight"],
                           original["model.layers.1.self_attn.kv_b_proj.weight"])


def test_the_export_note_says_q_a_and_kv_a_share_a_rank(trained, tmp_path):
    """vLLM packs q_a_proj and kv_a_proj_with_mqa into one module: the export says whether
    their ranks agree (they do by default; a rank pattern can make them differ)."""
    from megatron_lora.export.to_peft import _packed_note, export_peft

    notes = []
    export_peft(trained["exported"], str(tmp_path / "peft"), hf_config=trained["hf"],
                notes=notes)
    assert "q_a_proj and kv_a_proj_with_mqa have the same rank 4 (vLLM packs them" in \
        " ".join(notes), notes
    values = {"model.layers.1.self_attn.q_a_proj": (4, 8),
              "model.layers.1.self_attn.kv_a_proj_with_mqa": (2, 8)}
    assert _packed_note(DEEPSEEK_V3.names, values) == [
        "q_a_proj has rank 4, kv_a_proj_with_mqa rank 2: vLLM packs the two into one module "
        "and cannot serve different ranks (transformers + PEFT can)"]


def test_a_tp_size_mla_cannot_split_is_refused_before_any_work():
    info = model_info(dict(CONFIG, q_lora_rank=22, kv_lora_rank=14))
    problems = info.layout_problems(ParallelLayout(tp=4, sp=True), 4, flags=True)
    assert "--tensor-model-parallel-size 4 does not divide q_lora_rank = 22 (multi-latent " \
           "attention)" in problems, problems
    assert "--tensor-model-parallel-size 4 does not divide kv_lora_rank + qk_rope_head_dim = 18 " \
           "(multi-latent attention)" in problems, problems
    assert len(problems) == 2, problems
    assert not model_info(CONFIG).layout_problems(ParallelLayout(tp=2, sp=True), 2)


# ---- an NF4 base (--base-quantization nf4): MLA's projections quantised like every linear ----

# widths whose shards hold whole blocks of 64 at TP2: n * v_head_dim 128 (o_proj), shared and
# dense MLP 128 (their fc2), latent ranks 64
NF4_SIZES = dict(qk_nope_head_dim=12, v_head_dim=32, q_lora_rank=64, kv_lora_rank=64,
                 moe_intermediate_size=128, intermediate_size=128, num_hidden_layers=2,
                 num_nextn_predict_layers=0)


@pytest.fixture(scope="module")
def nf4_ds(tmp_path_factory):
    """The V3 model at NF4_SIZES, and a copy whose decoder linears (every `*_proj.weight` of a
    layer: MLA's, the experts', the shared expert's and the dense MLP's) are bitsandbytes' NF4
    round trip (kv_a_proj_with_mqa's too); transformers' logits of both."""
    import glob
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.convert.tiny import make_tokens
    from tests.models.test_nf4_layouts import bnb_round_trip

    root = tmp_path_factory.mktemp("deepseek_nf4")
    paths = {k: str(root / k) for k in ("hf", "hf_nf4")}
    make(paths["hf"], **NF4_SIZES)
    shutil.copytree(paths["hf"], paths["hf_nf4"])
    replaced = set()
    for f in glob.glob(os.path.join(paths["hf_nf4"], "*.safetensors")):
        tensors = load_file(f)
        for name, t in tensors.items():
            if ".layers." in name and name.endswith(("_proj.weight", "_mqa.weight")):
                tensors[name] = bnb_round_trip(t)
                replaced.add(name.split("self_attn.")[-1].split("mlp.")[-1])
        save_file(tensors, f, metadata={"format": "pt"})
    assert {"q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
            "kv_b_proj.weight", "o_proj.weight", "shared_experts.down_proj.weight"} <= replaced
    tokens = make_tokens(batch=2, seq=8, vocab=F.VOCAB)
    paths["reference"] = str(root / "reference.safetensors")
    nf4 = F.S.in_both(F.hf_logits, paths["hf_nf4"], tokens)  # fp32, fp64
    save_file({"tokens": tokens, "nf4": nf4[0].contiguous(), "nf4" + F.FP64: nf4[1].contiguous(),
               "full": F.hf_logits(paths["hf"], tokens).contiguous()}, paths["reference"])
    return paths


@pytest.mark.parametrize("layout,world_size", [
    pytest.param(ParallelLayout(), 1, id="1rank"),
    pytest.param(ParallelLayout(tp=2, ep=2, sp=True), 4, id="TP2xEP2+SP"),
])
def test_nf4_base_logits_match_transformers_on_the_round_trip(layout, world_size, nf4_ds):
    _nf4_logits(layout=layout, world_size=world_size, paths=nf4_ds)


@F.multirank(world_size=lambda world_size, **_: world_size, timeout=600)
def _nf4_logits(layout, world_size, paths):
    """The streamed NF4 load (`--base-quantization nf4`'s) of the full-precision checkpoint
    gives transformers' logits of the round-trip copy within 11x their fp32 rounding, and not the
    full model's."""
    from safetensors.torch import load_file

    from megatron_lora.cli.model_setup import build_base
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.logits import forward_logits
    from megatron_lora.models.build import model_config
    from megatron_lora.testing import parity

    ref = load_file(paths["reference"])
    info, hf, _ = open_hf(paths["hf"])
    model = build_base(info, model_config(info, layout), hf=hf, base_quantization="nf4")
    logits = forward_logits(model, ref["tokens"], info.vocab_size)
    if parity.assert_held_by(logits, 1, "the logits"):
        # our dequantised NF4 weights are the round-trip copy's values (one rounding each at
        # most, within compare.reference_bound's K)
        bound = F.S.assert_near_reference(logits, F.reference(ref, "nf4"),
                                          f"NF4 base at {layout.describe()} vs transformers")
        F.S.assert_moved(logits, ref["full"], bound, "NF4 quantisation")  # the base really is NF4


def test_an_fp8_checkpoint_converts_as_its_transformers_dequantised_copy(ds, tmp_path):
    """DeepSeek-V3 is published in fine-grained FP8: an FP8 copy of the V3 model (16 x 16
    blocks, partial ones at the edges; MLA's, the experts' and the MTP layer's weights) converts
    to what its copy dequantised by transformers' own `_dequantize_fp8_weight` converts to, bit
    for bit, the MTP layer included, and the way back writes no FP8 `quantization_config`."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from megatron_lora.convert.hf_to_mcore import hf_to_mcore
    from megatron_lora.convert.mcore_to_hf import mcore_to_hf
    from tests.convert.test_fp8 import tool
    from tests.convert.test_roundtrip import assert_bit_identical, read_hf_tensors

    fp8, deq = str(tmp_path / "fp8"), str(tmp_path / "deq")
    tool().make_fp8(ds["hf"], fp8, (16, 16))
    shutil.copytree(ds["hf"], deq)
    quantised = 0
    for shard in [f for f in os.listdir(fp8) if f.endswith(".safetensors")]:
        with safe_open(os.path.join(fp8, shard), framework="pt") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}
        out = {}
        for name, t in tensors.items():
            if name.endswith("_scale_inv"):
                continue
            if t.dtype == torch.float8_e4m3fn:
                t = _dequantize_fp8_weight(t, tensors[name + "_scale_inv"], [16, 16],
                                           torch.float32)
                quantised += 1
            out[name] = t.contiguous()
        save_file(out, os.path.join(deq, shard), metadata={"format": "pt"})
    assert quantised > 40  # MLA's five, the experts', the shared expert's, the dense MLP's, MTP's
    outs = {}
    for name, folder in (("fp8", fp8), ("deq", deq)):
        hf_to_mcore(folder, str(tmp_path / f"mcore_{name}"), progress=False)
        outs[name] = str(tmp_path / f"out_{name}")
        mcore_to_hf(str(tmp_path / f"mcore_{name}"), outs[name], progress=False)
    got, want = read_hf_tensors(outs["fp8"]), read_hf_tensors(outs["deq"])
    assert not any(k.endswith("_scale_inv") for k in got) and set(MTP) <= set(got)
    assert got["model.layers.4.eh_proj.weight"].dtype == torch.float32
    assert_bit_identical(want, got)
    assert "quantization_config" not in json.load(open(os.path.join(outs["fp8"], "config.json")))


def test_train_with_transformer_engine_layers_is_one_line_before_any_work(ds, tmp_path, capsys,
                                                                          monkeypatch):
    """MLA is built from the local layers: `--transformer-impl transformer_engine` is refused
    with one line naming the flag, nothing written."""
    from megatron_lora.cli import main
    from tests.data.tiny_tokenizers import mistral_folder

    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("LOCAL_WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517")):
        monkeypatch.setenv(k, v)
    save = str(tmp_path / "run")
    tok = mistral_folder(str(tmp_path / "tok"), vocab_size=F.VOCAB)
    code = main(["train", "--load-hf", ds["hf"], "--tokenizer", tok,
                 "--data-path", F.text_data(str(tmp_path / "data.jsonl")), "--seq-length", "16",
                 "--global-batch-size", "1", "--train-iters", "1", "--save", save,
                 "--transformer-impl", "transformer_engine"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert "--transformer-impl transformer_engine: multi-latent attention (DeepSeek) is built " \
           "from the local layers; use --transformer-impl local" in err, err
    assert not os.path.exists(save)


def test_nf4_layout_checks_read_mla_widths():
    """The CLI's NF4 width checks read MLA's inputs: linear_proj's is n x v_head_dim (128 at
    NF4_SIZES, 64 a TP2 rank), not n x (nope + rope) (64, 32 a rank); the latent ranks too."""
    from megatron_lora.models.nf4_model import nf4_layout_problems

    shape = model_info(dict(CONFIG, **NF4_SIZES)).shape
    assert nf4_layout_problems(shape, ParallelLayout(tp=2, ep=2, sp=True)) == []
    narrow = model_info(dict(CONFIG, **dict(NF4_SIZES, v_head_dim=16, kv_lora_rank=48))).shape
    assert nf4_layout_problems(narrow, ParallelLayout(tp=2, ep=2, sp=True)) == [
        "--base-quantization nf4: num_attention_heads x v_head_dim (input of linear_proj) = 64 "
        "split over --tensor-model-parallel-size 2 gives 32 input columns per rank, not a "
        "multiple of 64 (NF4 blocks are 64 input columns of one row); use a smaller "
        "--tensor-model-parallel-size",
        "--base-quantization nf4: kv_lora_rank (input of linear_kv_up_proj) = 48 is not a "
        "multiple of 64 (NF4 blocks are 64 input columns of one row); this model cannot be held "
        "in NF4"]
