"""GPT-OSS against transformers 5.24's own GptOssForCausalLM.

A tiny random model made by transformers in the test: learned sinks moved off their initial
values, a sliding window of 5 keys on alternate layers (shorter than the 12-token sequences),
non-zero biases on q/k/v/o, the router and the experts, a `swiglu_limit` of 0.4 that the gate and
up projections exceed, norms moved off 1, and expert weights that are exactly MXFP4 values (so
the same model can also be stored as `*_blocks` / `*_scales`), YaRN RoPE (factor 8 over 64
positions, non-default betas, no truncation; plain RoPE is off by more than 100 x the logits'
bound). Checked: config and refusals; the tensors megatron builds are the mapping's (keys,
global shapes, bytes)
at TP2+SP (ETP1) and PP2;
the round trip is bit-identical and the MXFP4 folder converts to the same checkpoint; logits
within compare.reference_bound of transformers' at 1 rank, PP2xEP2 (grouped experts) and
TP2xEP2+SP (ETP1), with megatron's DotProductAttention and with SDPAttention, and at each of
these layouts the logits
of a KV-cache decode (a 5-token prefill, then one token per step, positions 5-11 rotated past
the prompt and the window) as `generate` makes them; greedy `generate` at TP2+SP.
LoRA on every linear kind (attention, router, the fused experts' fc1/fc2, embedding, output
layer) trained at PP2xEP2 (ETP1) as at one rank, exported to PEFT with target_parameters on the
router and the fused experts (logits of transformers + PEFT), imported bit for bit, generated
with, and merged into the fused experts; an adapter PEFT makes itself on those parameters
imports with PEFT's own updates.
"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_lora.families import ModelConfigError, model_info
from megatron_lora.families.gpt_oss import GPT_OSS
from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing import compare, parity
from tests.families import _support as F
from tests.harness import multirank

LAYERS = ["sliding_attention", "full_attention"] * 2
# YaRN as the published models have it, scaled to the test: its frequency blend spans dims
# 0.3-3.5 of the 8 (not only the attention factor matters: tests/models/test_yarn.py)
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 8.0, "beta_slow": 0.5, "truncate": False, "rope_theta": 1000.0}
CONFIG = dict(vocab_size=250, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=5, layer_types=LAYERS, swiglu_limit=0.4,
              max_position_embeddings=512, initializer_range=0.1, rms_norm_eps=1e-5,
              rope_parameters=YARN,
              architectures=["GptOssForCausalLM"], model_type="gpt_oss")
VARIANTS = {"hf": {}}
EXPERTS = ("gate_up_proj", "down_proj")


def _mxfp4_values(shape_out_in, g):
    """Random MXFP4 blocks / scales for [E, out, in] and transformers' [E, in, out] values."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    e, rows, cols = shape_out_in
    blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(122, 126, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
    return blocks, scales, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def make(directory: str, seed: int = 0, **overrides) -> None:
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(seed)
    cfg = {k: v for k, v in dict(CONFIG, **overrides).items() if k != "model_type"}
    model = AutoModelForCausalLM.from_config(GptOssConfig(**cfg)).float()
    F.perturb_norms(model)
    g = torch.Generator().manual_seed(seed + 100)
    packed = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("_bias", ".bias")):
                p.normal_(0, 0.3, generator=g)
            elif name.endswith(".sinks"):
                p.normal_(0, 1.0, generator=g)
            elif name.endswith(EXPERTS):
                blocks, scales, values = _mxfp4_values(
                    (p.shape[0], p.shape[2], p.shape[1]), g)
                p.copy_(values)
                packed[name] = (blocks, scales)
    model.save_pretrained(directory)
    torch.save(packed, os.path.join(directory, "mxfp4.pt"))


def _mxfp4_folder(hf: str, out: str) -> str:
    """`hf` with its expert weights stored as MXFP4 pairs (the same values)."""
    os.makedirs(out)
    for name in os.listdir(hf):
        if name != "mxfp4.pt":
            shutil.copyfile(os.path.join(hf, name), os.path.join(out, name))
    packed = torch.load(os.path.join(hf, "mxfp4.pt"))
    tensors = load_file(os.path.join(out, "model.safetensors"))
    for name, (blocks, scales) in packed.items():
        del tensors[name]
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, os.path.join(out, "model.safetensors"))
    return out


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    paths = F.convert_and_reference(str(tmp_path_factory.mktemp("gpt_oss")), make, VARIANTS)
    return paths


def test_config_gives_the_sizes_megatron_builds():
    info = model_info(CONFIG)
    s = info.shape
    assert info.family is GPT_OSS and info.head_dim == 16 and s.kv_channels == 16
    assert s.add_bias_linear and s.attention_sinks and not s.moe_router_pre_softmax
    assert (s.swiglu_alpha, s.swiglu_limit) == (1.702, 0.4)
    assert s.sliding_window == 5 and s.window_layers == (True, False, True, False)
    assert (s.ffn_hidden_size, s.num_experts, s.moe_router_topk) == (32, 4, 2)
    assert (s.yarn.factor, s.yarn.original_max_position_embeddings, s.rotary_base) == \
        (8.0, 64, 1000.0)


def test_the_reference_logits_see_yarn(oss):
    """Control: transformers' own model with plain RoPE (same weights, same base) is off from
    the YaRN reference by more than 100 x the logits checks' bound, so they see YaRN."""
    ref = load_file(oss["reference"])
    model = F.hf_model(oss["hf"])
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": YARN["rope_theta"]}
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    model.model.rotary_emb = GptOssRotaryEmbedding(model.config)
    with torch.no_grad():
        plain = model(ref["tokens"]).logits.float()
    F.S.assert_moved(plain, ref["hf"], compare.reference_bound(*F.reference(ref, "hf")),
                     "YaRN (against plain RoPE)")


@pytest.mark.parametrize("change,message", [
    (dict(rope_parameters={"rope_type": "linear", "factor": 32.0, "rope_theta": 150000.0}),
     "only unscaled ('default') or 'yarn' RoPE"),
    (dict(rope_scaling={"rope_type": "yarn"}), "field 'rope_scaling.factor' must be"),
    (dict(layer_types=["sliding_attention"] * 3), "field 'layer_types' must list 4 of"),
    (dict(layer_types=["chunked_attention"] * 4), "field 'layer_types' must list 4 of"),
    (dict(attention_bias=False), "field attention_bias=false"),
    (dict(tie_word_embeddings=True), "field tie_word_embeddings=true"),
    (dict(swiglu_limit=-1.0), "field 'swiglu_limit' must be a positive number"),
])
def test_what_megatron_cannot_reproduce_is_refused_naming_the_field(change, message):
    with pytest.raises(ModelConfigError) as err:
        model_info(dict(CONFIG, **change), source="/m/config.json")
    assert str(err.value).startswith("/m/config.json: ") and message in str(err.value), err.value


def test_biased_experts_refuse_expert_tp_naming_the_flag():
    (problem,) = model_info(CONFIG).layout_problems(ParallelLayout(tp=2, sp=True), 2, flags=True)
    assert problem == ("experts with biases need --expert-tensor-parallel-size 1, got 2 (it "
                       "defaults to the tensor-parallel size)")


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2, sp=True, etp=1), ParallelLayout(pp=2)],
                         ids=["TP2+SP", "PP2"])
def test_megatron_builds_the_tensors_of_the_mapping(layout, oss):
    F.structure_matches_megatron(paths=oss, name="hf", layout=layout)


def test_round_trip_is_bit_identical_and_mxfp4_converts_alike(oss, tmp_path):
    from megatron_lora.convert.hf_to_mcore import hf_to_mcore
    from megatron_lora.convert.mcore_to_hf import mcore_to_hf
    from tests.convert.test_roundtrip import assert_bit_identical, read_hf_tensors

    out = str(tmp_path / "hf_out")
    mcore_to_hf(oss["mcore"], out, max_shard_bytes=200_000, progress=False)
    original = read_hf_tensors(oss["hf"])
    for suffix in ("self_attn.sinks", "mlp.router.bias", "self_attn.o_proj.bias",
                   "mlp.experts.gate_up_proj", "mlp.experts.down_proj_bias"):
        assert any(k.endswith(suffix) for k in original), suffix
    assert_bit_identical(original, read_hf_tensors(out))
    assert json.load(open(os.path.join(out, "config.json")))["layer_types"] == LAYERS

    packed = _mxfp4_folder(oss["hf"], str(tmp_path / "mxfp4"))
    assert any(k.endswith("gate_up_proj_blocks") for k in read_hf_tensors(packed))
    hf_to_mcore(packed, str(tmp_path / "mcore4"), progress=False)
    mcore_to_hf(str(tmp_path / "mcore4"), str(tmp_path / "back4"), progress=False)
    assert_bit_identical(original, read_hf_tensors(str(tmp_path / "back4")))

    from megatron_lora.convert.errors import ConversionError
    from megatron_lora.convert.hf_to_mcore import open_hf

    tensors = load_file(os.path.join(packed, "model.safetensors"))
    name = "model.layers.1.mlp.experts.down_proj"
    save_file({k: v for k, v in tensors.items() if k != name + "_scales"},
              os.path.join(packed, "model.safetensors"))
    with pytest.raises(ConversionError, match=f"tensor '{name}' is stored as MXFP4 but "
                                              f"{name}_scales is missing"):
        open_hf(packed)
    gate_up = "model.layers.1.mlp.experts.gate_up_proj"
    tensors[gate_up + "_blocks"] = tensors[gate_up + "_blocks"][:, :, :1].contiguous()
    tensors[gate_up + "_scales"] = tensors[gate_up + "_scales"][:, :, :1].contiguous()
    save_file(tensors, os.path.join(packed, "model.safetensors"))
    with pytest.raises(ConversionError, match=r"_blocks' has shape \[4, 64, 1, 16\], but "
                                              r"config.json implies \[4, 64, 2, 16\] \(MXFP4 "
                                              r"of the dense \[4, 64, 64\]\)"):
        open_hf(packed)


@multirank(world_size=lambda world_size, **_: world_size, timeout=600)
def _logits(layout, grouped, world_size, paths):
    """The converted checkpoint with megatron's DotProductAttention ("unfused") and with the
    default core attention (SDPAttention for windowed models), and the HF load: transformers'
    logits within compare.reference_bound (11 x transformers' own fp32 rounding, measured
    against its fp64 evaluation; for the kv-cache, of the positions it computes)."""
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf, load_mcore
    from megatron_lora.convert.logits import forward_logits
    from megatron_lora.models.build import build_model, model_config

    ref = load_file(paths["reference"])
    info, hf, _ = open_hf(paths["hf"])
    got = {}
    for backend, from_mcore in (("unfused", True), (None, True), (None, False)):
        model = build_model(info, model_config(info, layout), moe_grouped_gemm=grouped,
                            attention_backend=backend, use_te=False)
        load_mcore(model, paths["mcore"]) if from_mcore else load_hf(model, info, hf)
        got[(backend, from_mcore)] = forward_logits(model, ref["tokens"], info.vocab_size)
    got["kv-cache"] = _kv_cache_logits(model, ref["tokens"][0], info.vocab_size, prefill=5)
    want = F.reference(ref, "hf")
    for case, logit in got.items():
        what = f"{case} at {layout.describe()} vs transformers"
        if case == "kv-cache":
            if logit is not None:  # the last pipeline stage
                F.S.assert_near_reference(logit, tuple(r[0, 4:] for r in want), what)
        elif parity.assert_held_by(logit, 1, "the logits"):
            F.S.assert_near_reference(logit, want, what)


@torch.no_grad()
def _kv_cache_logits(model, tokens, vocab_size: int, prefill: int):
    """The logits `generate` decodes with: the first `prefill` tokens in one call, then each
    further token alone against the KV cache (positions past the prompt and the window, each
    step padded to the TP size under SP); [len - prefill + 1, vocab] for positions prefill-1..,
    None off the last pipeline stage."""
    from megatron.core import parallel_state

    from megatron_lora.inference.generate import _forward
    from megatron_lora.runtime.versions import static_kv_cache

    model.eval()
    tp_pad = (parallel_state.get_tensor_model_parallel_world_size()
              if model.config.sequence_parallel else 1)
    context = static_kv_cache(1, len(tokens) + tp_pad)
    ids = tokens.tolist()
    steps = [_forward(model, context, ids[:prefill], 0, tp_pad, vocab_size)]
    for pos in range(prefill, len(ids)):
        steps.append(_forward(model, context, ids[pos:pos + 1], pos, tp_pad, vocab_size))
    return None if steps[0] is None else torch.stack(steps)


@pytest.mark.parametrize("layout,grouped,world_size", [
    pytest.param(ParallelLayout(), False, 1, id="1rank"),
    pytest.param(ParallelLayout(pp=2, ep=2), True, 4, id="PP2xEP2-grouped"),
    pytest.param(ParallelLayout(tp=2, ep=2, sp=True, etp=1), False, 4, id="TP2xEP2+SP-ETP1"),
])
def test_logits_match_transformers(layout, grouped, world_size, oss):
    _logits(layout=layout, grouped=grouped, world_size=world_size, paths=oss)


# ---- LoRA: training, PEFT (target_parameters on the fused experts), merged export ----

TARGETS = ["linear_qkv", "linear_proj", "router", "linear_fc1", "linear_fc2", "embedding",
           "output_layer"]
ETP1 = ["--expert-tensor-parallel-size", "1"]  # biased experts


@pytest.fixture(scope="module")
def trained(oss):
    layout = (F.PP2_EP2[0], F.PP2_EP2[1] + ETP1, F.PP2_EP2[2])
    return F.train_and_export(oss, oss["hf"], TARGETS, layouts=(layout,),
                              infer=F.TP2_SP + tuple(ETP1))


def test_training_at_pp2_ep2_is_the_one_rank_run(trained):
    adapter = F.check_training_parity(trained, "run4")
    experts = "decoder.layers.mlp.experts.experts."
    assert tuple(adapter[experts + "linear_fc1.lora_B"].shape) == (4, 4, 64, 4)  # [L, E, 2f, r]
    for key in (experts + "linear_fc1.lora_B", experts + "linear_fc2.lora_B",
                "decoder.layers.mlp.router.lora.lora_B"):
        assert adapter[key].abs().amax(dim=(-2, -1)).gt(0).all(), key  # every layer and expert


def test_peft_export_loads_in_transformers_with_our_logits(trained, tmp_path):
    """PEFT's lora.ParamWrapper on GptOssExperts' [E, in, out] parameters: lora_B's rows are
    gate_up_proj's interleaved columns (written in megatron's [gate; up] order the logits were
    off by 0.96)."""
    from megatron_lora.export.to_peft import export_peft

    config = F.check_peft_logits(trained)
    assert config["auto_mapping"]["base_model_class"] == "GptOssForCausalLM"
    assert config["target_parameters"] == ["mlp.router.weight", "mlp.experts.gate_up_proj",
                                           "mlp.experts.down_proj"]
    assert sorted(config["target_modules"]) == sorted(
        ["embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "lm_head"])
    assert config["use_rslora"] is True and config["lora_dropout"] == 0.0
    notes = []
    export_peft(trained["exported"], str(tmp_path / "again"), hf_config=trained["hf"],
                notes=notes)
    (note,) = notes  # ParamWrapper takes no dropout: the training value is not written
    assert note.startswith("lora_dropout=0.1 (the training setting) written as 0") and \
        "keeps router, gate_up_proj, down_proj as fused parameters" in note, note


def test_import_of_the_export_is_bit_identical(trained, tmp_path):
    F.check_import_is_bit_identical(trained, str(tmp_path / "back"))


def test_greedy_generate_with_the_adapter_is_transformers_peft(trained, tmp_path):
    F.check_generate(trained, str(tmp_path))


def test_merged_export_is_the_adapted_model(trained, tmp_path):
    """export hf --merge adds each expert's update to the fused, interleaved gate_up_proj and
    to down_proj ([E, in, out]): transformers' logits of the merged folder are those of
    `logits --adapter`."""
    from megatron_lora.export.merged import export_merged_hf

    out = str(tmp_path / "merged")
    export_merged_hf(trained["mcore"], trained["run4"], out, progress=False)
    tokens = torch.tensor(json.load(open(trained["tokens"])))
    # bound: transformers' own fp32 rounding on the merged folder (compare.reference_bound);
    # the merge's one rounding per weight is of the size of one more matmul's, within K
    F.S.assert_near_reference(load_file(trained["logits"])["logits"],
                              F.S.in_both(F.hf_logits, out, tokens),
                              "logits --adapter vs transformers on the merged export")


def test_peft_s_own_fused_adapter_imports_with_peft_s_updates(oss, tmp_path):
    """An adapter PEFT makes itself on GptOssForCausalLM (random non-zero factors, rsLoRA) on
    the router and both fused expert parameters: `import peft` gives every expert's fc1 / fc2
    and every router the update PEFT's own ParamWrapper.get_delta_weight computes, [E, in, out]
    transposed to megatron's [out, in] and gate_up_proj's interleaved columns taken as
    [gate; up]."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import ParamWrapper

    from megatron_lora.export.adapter_ckpt import AdapterCheckpoint
    from megatron_lora.export.from_peft import import_peft
    from megatron_lora.export.table import KIND_BY_NAME, sites
    from megatron_lora.families import read_hf_config

    torch.manual_seed(7)
    model = get_peft_model(F.hf_model(oss["hf"]), LoraConfig(
        r=2, lora_alpha=3, use_rslora=True, init_lora_weights=False, target_modules=[],
        target_parameters=["mlp.router.weight", "mlp.experts.gate_up_proj",
                           "mlp.experts.down_proj"]))
    saved, back = str(tmp_path / "peft"), str(tmp_path / "back")
    model.save_pretrained(saved)
    import_peft(saved, back, hf_config=oss["hf"])
    peft = {}  # (kind, layer) -> PEFT's update in megatron's [E, out, in] ([E, out] router)
    for name, mod in model.named_modules():
        if isinstance(mod, ParamWrapper):
            delta = mod.get_delta_weight("default").detach().float()
            layer = int(name.split(".layers.")[1].split(".")[0])
            if mod.parameter_name == "gate_up_proj":  # [E, h, 2f], columns gate, up, gate, ...
                delta = torch.cat([delta[:, :, 0::2], delta[:, :, 1::2]], dim=2)
            kind = {"gate_up_proj": "linear_fc1", "down_proj": "linear_fc2"}.get(
                mod.parameter_name, "router")
            peft[(kind, layer)] = delta if kind == "router" else delta.transpose(1, 2)
    info = read_hf_config(oss["hf"])
    ckpt = AdapterCheckpoint(back, info)
    assert sorted(k.name for k in ckpt.kinds()) == ["linear_fc1", "linear_fc2", "router"]
    for kind in ("router", "linear_fc1", "linear_fc2"):
        for site in sites(info, KIND_BY_NAME[kind]):
            a, b = ckpt.factors(site)
            scale = ckpt.scaling(site)[2]
            ours = scale * (b.float() @ a.float())
            want = peft[(kind, site.index[0])]
            want = want if kind == "router" else want[site.index[1]]
            assert want.abs().max() > 0.1  # non-zero factors
            # each side: an r-term fp32 dot product, the scale rounded to fp32 and one product:
            # within (r + 2) u of the exact value relative to scale x |b| @ |a| (Higham, eq.
            # 4.4), so the two within twice that, element by element
            bound = 2 * (b.shape[-1] + 2) * compare.unit_roundoff(torch.float32) * abs(scale) \
                * (b.float().abs() @ a.float().abs())
            compare.assert_within(ours, want, bound, f"{site.name}: scale x B @ A vs PEFT's")


def test_what_peft_cannot_express_is_refused_naming_the_flag(oss, tmp_path):
    """PEFT's fused experts take one r and lora_alpha: an adapter whose experts differ (here
    expert 1's alpha, --lora-alpha-pattern) is refused before anything is written; a family
    with fused experts that PEFT does not take as target_parameters is refused too."""
    import dataclasses

    from megatron_lora.convert.errors import ConversionError
    from megatron_lora.export.adapter_ckpt import write_adapter_checkpoint
    from megatron_lora.export.peft_fused import refuse_fused_experts
    from megatron_lora.export.table import KIND_BY_NAME, factor_shapes
    from megatron_lora.export.to_peft import export_peft
    from megatron_lora.families import read_hf_config
    from megatron_lora.lora.model import LoraConfig

    info = read_hf_config(oss["hf"])
    config = LoraConfig(r=2, lora_alpha=4.0, target_modules=["linear_fc1"],
                        alpha_pattern={r"experts\.1\.linear_fc1$": 8.0})
    a_shape, b_shape = factor_shapes(info, KIND_BY_NAME["linear_fc1"], 2)
    adapter = str(tmp_path / "adapter")
    write_adapter_checkpoint(adapter, info, {"linear_fc1": 2},
                             lambda site: (torch.ones(a_shape[2:]), torch.ones(b_shape[2:])),
                             config, torch.float32)
    with pytest.raises(ConversionError, match=rf"^{adapter}: the routed experts' adapters have "
                       r"different \(rank, alpha\) \[\(2, 4.0\), \(2, 8.0\)\] "
                       r"\(--lora-rank-pattern / --lora-alpha-pattern\)"):
        export_peft(adapter, str(tmp_path / "out"), hf_config=oss["hf"])
    assert not (tmp_path / "out").exists()

    unfused = dataclasses.replace(info, family=dataclasses.replace(info.family,
                                                                   peft_fused_experts=False))
    with pytest.raises(ConversionError, match="PEFT adapters for GptOssForCausalLM \\(fused "
                                              "experts without target_parameters\\)"):
        refuse_fused_experts(unfused)
    refuse_fused_experts(info)  # GPT-OSS: target_parameters


def test_greedy_generate_past_the_window_is_transformers(oss, tmp_path):
    """Greedy `generate` at TP2+SP (ETP1, in the warm world; KV-cache steps padded to the TP
    size, past an 18-token prompt with a window of 5) gives the tokens of a greedy loop over
    transformers' forwards. Before SDPAttention kept such steps causal, the first prompt
    diverged at its second new token."""
    from transformers import AutoTokenizer

    from tests.data.tiny_tokenizers import mistral_folder

    tok_dir = mistral_folder(str(tmp_path / "tok"), vocab_size=F.VOCAB)
    prompts = [{"prompt": "hello there how are you the sky is blue"},
               {"prompt": "the sky is blue fine"}]
    path, out = str(tmp_path / "prompts.jsonl"), str(tmp_path / "out.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(p) + "\n" for p in prompts)
    F.inference.generate(["--load-hf", oss["hf"], "--tokenizer", tok_dir, "--prompts", path,
                          "--out", out, "--max-new-tokens", "8", "--tensor-model-parallel-size",
                          "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"])
    rows = [json.loads(line) for line in open(out)]
    tok, model = AutoTokenizer.from_pretrained(tok_dir), F.hf_model(oss["hf"])
    with torch.no_grad():
        for p, row in zip(prompts, rows):
            ids, new = tok(p["prompt"]).input_ids, []
            for _ in range(8):
                new.append(int(model(torch.tensor([ids + new])).logits[0, -1].argmax()))
                if new[-1] == tok.eos_token_id:
                    break
            assert len(ids) > CONFIG["sliding_window"]
            assert row["token_ids"] == new, (p, row["token_ids"], new)
