"""YaRN RoPE: config.json -> families/common.py `read_yarn` -> megatron-core's YarnRotaryEmbedding
and SelfAttention's factor, against transformers 5.24's own GptOssRotaryEmbedding.

For each config (the published gpt-oss one, transformers' GptOssConfig default when a config has
no RoPE fields, the `rope_parameters` form, truncation on, other betas, a top-level
`original_max_position_embeddings`, DeepSeek-style mscale pairs, a lone mscale) the cos and sin
megatron rotates q and k with (its embedding of the positions, times the factor SelfAttention
reads from the TransformerConfig) equal transformers' (cos, sin times `attention_scaling`) in
fp32 over 300 positions, within the rounding of two fp32 evaluations of the rule (_bound).
Controls: plain RoPE, and plain RoPE times the attention factor (only the frequency blend
missing), are off by more than 1e-2 at the positions of the GPT-OSS logits test
(tests/families/test_gpt_oss.py); megatron's own mscale rule applied to a lone mscale is off too.
Bad fields are refused naming them.
"""

import math

import pytest
import torch
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    YarnRotaryEmbedding, _yarn_get_concentration_factor_from_config)
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

from megatron_lora.families import ModelConfigError, model_info
from megatron_lora.families.shape import YarnRope
from megatron_lora.models.gpt import transformer_config
from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing.compare import assert_within, unit_roundoff

BASE = dict(vocab_size=250, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, max_position_embeddings=512,
            architectures=["GptOssForCausalLM"], model_type="gpt_oss")
PUBLISHED = {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
             "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False}
# the GPT-OSS logits test's YaRN (tests/families/test_gpt_oss.py): the ramp spans dims 0.3-3.5
TEST_MODEL = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
              "beta_fast": 8.0, "beta_slow": 0.5, "truncate": False, "rope_theta": 1000.0}
CONFIGS = {
    "published": dict(head_dim=64, rope_scaling=PUBLISHED, rope_theta=150000,
                      max_position_embeddings=131072),
    "class-default": dict(head_dim=64),
    "test-model": dict(rope_parameters=TEST_MODEL),
    "truncate": dict(rope_parameters=dict(TEST_MODEL, truncate=True)),
    "default-betas": dict(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 128}),
    "top-level-original": dict(rope_parameters={"rope_type": "yarn", "factor": 8.0,
                                                "original_max_position_embeddings": 4096},
                               original_max_position_embeddings=77, rope_theta=1000),
    "mscale-pair": dict(rope_scaling={"type": "yarn", "factor": 40.0, "mscale": 1.0,
                                      "mscale_all_dim": 0.8,
                                      "original_max_position_embeddings": 64}),
    "lone-mscale": dict(rope_parameters={"rope_type": "yarn", "factor": 40.0, "mscale": 0.707,
                                         "original_max_position_embeddings": 64}),
}


def _hf_cos_sin(cfg: dict, positions: int):
    """transformers' (cos, sin) [positions, d/2], attention_scaling applied, fp32."""
    hf = GptOssConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    rotary = GptOssRotaryEmbedding(hf)
    x = torch.zeros(1, positions, cfg["head_dim"])
    cos, sin = rotary(x, torch.arange(positions)[None])
    return cos[0], sin[0]


def _bound(cfg: dict, positions: int) -> torch.Tensor:
    """Per element [position p, frequency j]: how far two fp32 evaluations of YaRN's cos/sin
    (times the attention factor c) can lie apart. Each side computes the frequency
    f_j = inter_j (1 - m_j) + extra_j m_j (extra = base**-(2j/d), inter = extra / factor, m the
    ramp mask) within delta f_j of exact: the exponent's rounding moves base**x by ln(base) u
    relative, the power, reciprocal and division by the factor add a few u, and the mask's
    ~3 roundings (absolute, m in [0, 1]) move f by 3 u |extra - inter| <= 3 u factor f: delta =
    (10 + 3 factor + ln(base)) u. The angle p f_j is then within theta (delta + u) of exact
    (theta = p f_j), cos and sin (1-Lipschitz; torch's within 2 u) add 2 u, the product by c
    one more u: per side c (theta (delta + u) + 3 u), twice for two sides. Tight where theta is
    small: the interpolated (low) frequencies the YaRN blend changes, and position 0 (c itself),
    which is where a wrong blend, ramp or factor shows."""
    hf = GptOssConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    rotary = GptOssRotaryEmbedding(hf)
    info = model_info(cfg).shape
    u = unit_roundoff(torch.float32)
    delta = (10 + 3 * info.yarn.factor + math.log(info.rotary_base)) * u
    theta = torch.arange(positions, dtype=torch.float64)[:, None] * rotary.inv_freq.double()
    return 2 * rotary.attention_scaling * (theta * (delta + u) + 3 * u)


def _megatron_cos_sin(cfg: dict, positions: int, monkeypatch, mscale_override=None):
    """What megatron rotates q and k with for the config as megatron_lora builds it: GPTModel's
    YarnRotaryEmbedding (made with the arguments GPTModel passes from the TransformerConfig)
    and SelfAttention's factor `_yarn_get_concentration_factor_from_config(config)`."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    shape = model_info(cfg).shape
    config = transformer_config(shape, ParallelLayout())
    if mscale_override is not None:  # megatron's own defaults for a lone mscale
        config.yarn_mscale, config.yarn_mscale_all_dim = mscale_override
    rotary = YarnRotaryEmbedding(
        kv_channels=config.kv_channels, rotary_percent=shape.rotary_percent,
        rotary_base=int(shape.rotary_base), use_cpu_initialization=True,
        scaling_factor=config.yarn_rotary_scaling_factor,
        original_max_position_embeddings=config.yarn_original_max_position_embeddings,
        beta_fast=config.yarn_beta_fast, beta_slow=config.yarn_beta_slow,
        mscale=config.yarn_mscale, mscale_all_dim=config.yarn_mscale_all_dim,
        correction_range_round_to_int=config.yarn_correction_range_round_to_int)
    emb, _ = rotary(positions)
    half = emb[:, 0, 0, : emb.shape[-1] // 2]
    assert torch.equal(emb[:, 0, 0, half.shape[-1]:], half)  # rotate-half layout
    factor = _yarn_get_concentration_factor_from_config(config)
    return half.cos() * factor, half.sin() * factor


@pytest.mark.parametrize("name", CONFIGS)
def test_megatron_rotates_with_transformers_cos_and_sin(name, monkeypatch):
    cfg = dict(BASE, **CONFIGS[name])
    cos, sin = _megatron_cos_sin(cfg, 300, monkeypatch)
    ref_cos, ref_sin = _hf_cos_sin(cfg, 300)
    assert cos.shape == ref_cos.shape
    bound = _bound(cfg, 300)
    assert_within(cos, ref_cos, bound, f"{name} cos [position, frequency]")
    assert_within(sin, ref_sin, bound, f"{name} sin [position, frequency]")
    rotary = GptOssRotaryEmbedding(GptOssConfig(**{k: v for k, v in cfg.items()
                                                   if k != "model_type"}))
    assert model_info(cfg).shape.yarn.attention_factor == rotary.attention_scaling


def test_without_yarn_or_its_blend_the_rotation_is_off():
    """At the GPT-OSS logits test's positions (< 32), plain RoPE and plain RoPE times the
    attention factor are both far from YaRN's: the test model's logits see the blend."""
    cfg = dict(BASE, **CONFIGS["test-model"])
    cos, sin = _hf_cos_sin(cfg, 32)
    plain_cos, plain_sin = _hf_cos_sin(dict(cfg, rope_parameters={
        "rope_type": "default", "rope_theta": 1000.0}), 32)
    factor = model_info(cfg).shape.yarn.attention_factor
    assert (cos - plain_cos).abs().max() > 1e-2
    assert (cos - plain_cos * factor).abs().max() > 1e-2
    assert (sin - plain_sin * factor).abs().max() > 1e-2


def test_megatrons_own_mscale_rule_differs_for_a_lone_mscale(monkeypatch):
    """transformers ignores `mscale` without `mscale_all_dim` (factor 0.1 ln f + 1); megatron's
    rule with the pair (0.707, None -> its default 0) would use 0.1 * 0.707 ln f + 1. The
    mapping (models/gpt.py `_set_yarn`) passes the pair only when both are non-zero."""
    cfg = dict(BASE, **CONFIGS["lone-mscale"])
    ref_cos, _ = _hf_cos_sin(cfg, 40)
    cos, _ = _megatron_cos_sin(cfg, 40, monkeypatch, mscale_override=(0.707, 0.0))
    assert (cos - ref_cos).abs().max() > 1e-2


def test_the_published_configs_read_as_yarn():
    info = model_info(dict(BASE, **CONFIGS["published"]))
    assert info.shape.yarn == YarnRope(factor=32.0, original_max_position_embeddings=4096,
                                       beta_fast=32.0, beta_slow=1.0, truncate=False)
    assert info.shape.rotary_base == 150000.0
    # transformers 5 saves the same as rope_parameters with rope_theta inside
    saved = dict(BASE, head_dim=64, rope_parameters=dict(PUBLISHED, rope_theta=150000.0))
    assert model_info(saved).shape.yarn == info.shape.yarn
    plain = dict(BASE, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert model_info(plain).shape.yarn is None


@pytest.mark.parametrize("change,message", [
    (dict(rope_scaling={"rope_type": "yarn"}),
     "field 'rope_scaling.factor' must be a positive number, got nothing"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 0.5}),
     "field 'rope_parameters.factor' must be a number >= 1, got 0.5"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": "32"}),
     "field 'rope_parameters.beta_fast' must be a positive number, got the string"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "truncate": "false"}),
     "field 'rope_parameters.truncate' must be true or false"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                           "original_max_position_embeddings": 4096.0}),
     "field 'rope_parameters.original_max_position_embeddings' must be a positive integer"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": -1}),
     "field 'rope_parameters.mscale' must be a number >= 0 or null"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.2}),
     "field 'rope_parameters.attention_factor' is not supported"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}),
     "field 'rope_parameters.partial_rotary_factor' must be 1 with YaRN"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 1.0}),
     "field 'rope_parameters.low_freq_factor' is not a YaRN parameter"),
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0}}),
     "field 'rope_parameters.full_attention' is an object: RoPE parameters per layer type"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 4.0}),
     "field rope_type='linear': only unscaled ('default') or 'yarn' RoPE is supported"),
])
def test_bad_yarn_fields_are_refused_naming_them(change, message):
    with pytest.raises(ModelConfigError) as err:
        model_info(dict(BASE, **change), source="/m/config.json")
    assert str(err.value).startswith("/m/config.json: ") and message in str(err.value), err.value


def test_families_without_yarn_still_refuse_it():
    qwen = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=256,
                hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                num_experts=4, num_experts_per_tok=2, head_dim=16,
                rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ModelConfigError, match=r"only unscaled \('default'\) RoPE is supported"):
        model_info(qwen)
