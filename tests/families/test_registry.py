"""A config.json selects its family by `architectures`, else by `model_type`; a config of no
supported family is refused before any work, naming the file and listing the families."""

import json

import pytest

from megatron_lora.families import (FAMILIES, ModelConfigError, family_of, model_info,
                                    read_hf_config)
from megatron_lora.families.mixtral import MIXTRAL
from tests.convert.tiny import TINY_CONFIG


def test_every_family_has_a_unique_name_and_unique_selectors():
    names = [f.name for f in FAMILIES]
    archs = [a for f in FAMILIES for a in f.architectures]
    types = [t for f in FAMILIES for t in f.model_types]
    assert len(set(names)) == len(names) and len(set(archs)) == len(archs)
    assert len(set(types)) == len(types)


@pytest.mark.parametrize("selector", [dict(architectures=["MixtralForCausalLM"]),
                                      dict(architectures=None, model_type="mixtral"),
                                      dict(architectures=["Other", "MixtralForCausalLM"])])
def test_mixtral_is_found_by_architecture_or_model_type(selector):
    cfg = dict(TINY_CONFIG, **selector)
    assert family_of(cfg) is MIXTRAL
    info = model_info(cfg)
    assert info.family is MIXTRAL and info.head_dim == 16


def test_an_unsupported_family_is_refused_listing_the_supported(tmp_path):
    cfg = dict(TINY_CONFIG, architectures=["LlamaForCausalLM"], model_type="llama")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError) as err:
        read_hf_config(str(tmp_path))
    assert str(err.value) == (
        f"{path}: architectures=['LlamaForCausalLM'] (model_type='llama') is not a supported "
        f"model family; supported: mixtral (MixtralForCausalLM), qwen3_moe (Qwen3MoeForCausalLM), "
        f"qwen2_moe (Qwen2MoeForCausalLM), olmoe (OlmoeForCausalLM), gpt_oss (GptOssForCausalLM), "
        f"glm4_moe (Glm4MoeForCausalLM), deepseek_v3 (DeepseekV3ForCausalLM), deepseek_v2 "
        f"(DeepseekV2ForCausalLM)")


def test_mixtral_names_are_its_checkpoint_names():
    n = MIXTRAL.names
    assert n.layer.format(l=3) + n.expert.format(e=1) + n.expert_gate == \
        "model.layers.3.block_sparse_moe.experts.1.w1.weight"
    assert n.kind_modules()["linear_fc1"] == ("w1", "w3")
    assert MIXTRAL.checkpoint_format == "megatron_lora.mixtral.torch_dist"
    assert MIXTRAL.base_model_class == "MixtralForCausalLM"


def test_model_shape_checks_the_gpt_oss_fields_on_construction():
    from megatron_lora.families.shape import ModelShape

    base = dict(vocab_size=16, hidden_size=8, ffn_hidden_size=12, num_layers=2,
                num_attention_heads=2, num_query_groups=1, max_position_embeddings=32)
    with pytest.raises(ValueError, match="swiglu_alpha and swiglu_limit go together"):
        ModelShape(**base, swiglu_limit=7.0)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        ModelShape(**base, sliding_window=0)
    with pytest.raises(ValueError, match=r"window_layers needs sliding_window and one entry"):
        ModelShape(**base, sliding_window=4, window_layers=[True])
    # a JSON list read back becomes the tuple the shape holds
    assert ModelShape(**base, sliding_window=4, window_layers=[1, 0]).window_layers == (True, False)
