"""config.json fields are type-checked strictly: a wrong type, null where transformers allows no
None, a non-finite or non-positive number, unreadable bytes or JSON all give one
ModelConfigError naming the file (once), the field and what it got."""

import json

import pytest

from megatron_lora.lora.model import LoraConfig
from megatron_lora.lora.sizes import model_problems
from megatron_lora.families import ModelConfigError, model_info, read_hf_config
from tests.convert.tiny import TINY_CONFIG

BASE = dict(TINY_CONFIG, architectures=["MixtralForCausalLM"], model_type="mixtral")
CONFIG_V2 = dict(vocab_size=250, hidden_size=64, intermediate_size=80, moe_intermediate_size=32,
                 num_hidden_layers=2, num_attention_heads=4, n_routed_experts=8,
                 num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=None, kv_lora_rank=16,
                 qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                 architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2")


def _write(tmp_path, text, name="config.json"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


@pytest.mark.parametrize("change,message", [
    # A string "false" is truthy: it used to tie the embeddings and drop lm_head silently.
    (dict(tie_word_embeddings="false"),
     "field 'tie_word_embeddings' must be true or false, got the string \"false\""),
    (dict(tie_word_embeddings=None), "field 'tie_word_embeddings' must be true or false, got null"),
    (dict(rms_norm_eps=None), "field 'rms_norm_eps' must be a positive number, got null"),
    (dict(rms_norm_eps=-1e-5), "field 'rms_norm_eps' must be a positive number, got -1e-05"),
    (dict(rms_norm_eps=0), "field 'rms_norm_eps' must be a positive number, got 0"),
    (dict(rope_theta=float("nan")), "field 'rope_theta' must be a positive number, got NaN"),
    (dict(rope_theta=float("inf")), "field 'rope_theta' must be a positive number, got Infinity"),
    (dict(rope_theta=10 ** 400), "field 'rope_theta' must be a positive number, got 1000000000"),
    (dict(rope_theta=1e6 + 0.5), "field 'rope_theta' must be a positive whole number"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": "1e6"}),
     "field 'rope_parameters.rope_theta' must be a positive number, got the string \"1e6\""),
    (dict(sliding_window="4096"),
     "field 'sliding_window' must be a positive integer or null, got the string \"4096\""),
    (dict(rope_scaling="linear"), "field 'rope_scaling' must be an object or null, got the string"),
    (dict(rope_scaling=[2.0]),
     "field 'rope_scaling' must be an object or null, got an array [2.0]"),
    (dict(rope_parameters=["default"]), "field 'rope_parameters' must be an object or null"),
    (dict(vocab_size=1e9), "field 'vocab_size' must be a positive integer, got 1000000000.0"),
    (dict(hidden_size=True), "field 'hidden_size' must be a positive integer, got true"),
    (dict(num_hidden_layers="4"), "field 'num_hidden_layers' must be a positive integer, got the"),
    (dict(num_key_value_heads=2.0),
     "field 'num_key_value_heads' must be a positive integer or null"),
    (dict(head_dim="16"), "field 'head_dim' must be a positive integer or null"),
    (dict(attention_bias="no"), "field 'attention_bias' must be true or false"),
    (dict(hidden_act=None), "field 'hidden_act' must be a string, got null"),
    (dict(dtype=32), "field 'dtype' must be a string or null, got 32"),
    (dict(architectures="MixtralForCausalLM"), "field 'architectures' must be a list or null"),
    (dict(architectures=[["MixtralForCausalLM"]]),
     "field 'architectures' must be a list of strings"),
])
def test_wrong_field_types_are_named(change, message):
    with pytest.raises(ModelConfigError) as info:
        model_info(dict(BASE, **change), source="/m/config.json")
    text = str(info.value)
    assert text.startswith("/m/config.json: ") and text.count("/m/config.json") == 1, text
    assert message in text, text


def test_a_missing_field_takes_transformers_default_and_says_so_when_refused():
    cfg = dict(BASE)
    del cfg["hidden_size"]
    info = model_info(cfg)  # MixtralConfig's default, as transformers reads the file
    assert info.shape.hidden_size == 4096 and info.defaulted == (("hidden_size", 4096),)
    assert "config.json does not set hidden_size: transformers' defaults hidden_size=4096" in \
        info.defaults_note()
    del cfg["num_experts_per_tok"], cfg["num_local_experts"]  # defaults 2 of 8: fine
    assert model_info(cfg).shape.moe_router_topk == 2
    v2 = dict(CONFIG_V2)
    del v2["num_experts_per_tok"]  # DeepseekV2Config's default is None: no model
    with pytest.raises(ModelConfigError, match="field 'num_experts_per_tok' must be a positive "
                       r"integer, got nothing \(the field is missing, and transformers' default "
                       r"is null\)"):
        model_info(v2)


@pytest.mark.parametrize("change", [
    dict(sliding_window=None), dict(head_dim=None),
    dict(rope_scaling=None), dict(rope_parameters=None), dict(dtype=None), dict(torch_dtype=None),
    dict(architectures=None),
])
def test_null_is_accepted_where_transformers_accepts_none(change):
    info = model_info(dict(BASE, **change))
    assert info.shape == model_info(BASE).shape


def test_valid_types_keep_their_meaning():
    tied = model_info(dict(BASE, tie_word_embeddings=True))
    untied = model_info(dict(BASE, tie_word_embeddings=False))
    assert tied.shape.tie_embeddings is True and untied.shape.tie_embeddings is False
    info = model_info(dict(BASE, rms_norm_eps=1e-6, num_key_value_heads=None,
                                           rope_parameters={"rope_type": "default",
                                                            "rope_theta": 5e5}))
    assert info.shape.norm_epsilon == 1e-6 and info.shape.num_query_groups == 4
    assert info.shape.rotary_base == 5e5


def test_non_utf8_config_names_file_and_byte(tmp_path):
    text = json.dumps(BASE, indent=1).replace('"mixtral"', '"mixtr\xe9l"').encode("latin-1")
    path = _write(tmp_path, text)
    with pytest.raises(ModelConfigError) as info:
        read_hf_config(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: not UTF-8 (byte 0xe9 at line ") and "column" in msg, msg
    assert msg.count(path) == 1


def test_deeply_nested_config_is_an_error_not_a_recursion_traceback(tmp_path):
    path = _write(tmp_path, '{"a": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(ModelConfigError, match="JSON nested too deeply"):
        read_hf_config(path)


@pytest.mark.parametrize("text,message", [
    ('{"vocab_size": 250,', "not valid JSON (Expecting property name enclosed in double quotes "
                            "at column 20)"),
    ("[1, 2]", "expected a JSON object, got an array [1, 2]"),
    ("", "not valid JSON (Expecting value at column 1)"),
])
def test_invalid_json_names_file_once(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ModelConfigError) as info:
        read_hf_config(path)
    assert str(info.value) == f"{path}: {message}"


def test_unreadable_config_gives_the_reason_without_repeating_the_path(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").mkdir()  # a directory where the file should be
    path = str(tmp_path / "model" / "config.json")
    with pytest.raises(ModelConfigError) as info:
        read_hf_config(str(tmp_path / "model"))
    assert str(info.value) == f"{path}: cannot read: Is a directory"
    with pytest.raises(ModelConfigError) as info:
        read_hf_config(str(tmp_path / "nothing.json"))
    assert str(info.value) == f"{tmp_path / 'nothing.json'}: file not found"


def test_lora_rank_larger_than_the_router_names_the_flag_and_sizes():
    """4 experts: the router's weight is [4, 64], so rank 8 cannot fit; found from the sizes,
    before any model exists."""
    info = model_info(BASE)
    lora = LoraConfig(r=8, target_modules=["linear_qkv", "router"])
    problems = model_problems(lora, info, rank_name="--lora-rank",
                              pattern_name="--lora-rank-pattern",
                              targets_name="--lora-target-modules")
    assert problems == [
        "LoRA rank 8 (--lora-rank) exceeds min(in_features, out_features) = 4 of router "
        "(in_features 64 = hidden size, out_features 4 = number of experts); use a rank <= 4 "
        "(for router alone: --lora-rank-pattern router=R) or drop router from "
        "--lora-target-modules"]
    # A smaller rank for the router alone is fine; only the ranks each kind really gets count.
    assert model_problems(LoraConfig(r=8, target_modules=["linear_qkv", "router"],
                                     rank_pattern={"router": 4}), info) == []
    assert "LoRA rank 5 (LoraConfig.r or rank_pattern)" in model_problems(LoraConfig(
        r=2, target_modules=["router"], rank_pattern={"router": 5}), info)[0]
