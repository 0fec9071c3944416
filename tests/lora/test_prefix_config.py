"""LoraConfig's prefix-tuning fields (num_virtual_tokens, prefix_projection,
encoder_hidden_size): validated on construction with messages naming the field and the train
flag, never combined with LoRA settings, and carried through to_dict / the checkpoint reader."""

import pytest

from megatron_lora.lora.model import LoraConfig


def test_a_prefix_config_has_no_lora_targets_and_round_trips():
    from megatron_lora.export.adapter_ckpt import lora_config_from_dict

    config = LoraConfig(num_virtual_tokens=5, target_modules=(), prefix_projection=True,
                        encoder_hidden_size=12, seed=3, dtype="bf16")
    assert config.peft_type == "PREFIX_TUNING" and config.target_modules == ()
    d = config.to_dict()
    assert (d["num_virtual_tokens"], d["prefix_projection"], d["encoder_hidden_size"]) == (
        5, True, 12)
    assert lora_config_from_dict(d) == config
    plain = LoraConfig()
    assert plain.peft_type == "LORA" and "num_virtual_tokens" not in plain.to_dict()


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_virtual_tokens=4), "LoraConfig.num_virtual_tokens (prefix tuning, --peft-type "
     "prefix) cannot be combined with target_modules"),
    (dict(num_virtual_tokens=4, target_modules=(), use_dora=True), "cannot be combined with "
     "use_dora"),
    (dict(num_virtual_tokens=4, target_modules=(), rank_pattern={"x": 2}),
     "rank_pattern / alpha_pattern are LoRA settings"),
    (dict(num_virtual_tokens=-1, target_modules=()), "LoraConfig.num_virtual_tokens "
     "(--num-virtual-tokens) must be an integer >= 0, got -1"),
    (dict(num_virtual_tokens=2.5, target_modules=()), "must be an integer >= 0, got 2.5"),
    (dict(prefix_projection=True), "need num_virtual_tokens > 0"),
    (dict(num_virtual_tokens=4, target_modules=(), encoder_hidden_size=8),
     "encoder_hidden_size (--prefix-encoder-hidden-size) needs prefix_projection"),
    (dict(num_virtual_tokens=4, target_modules=(), prefix_projection=True,
          encoder_hidden_size=0), "must be a positive integer or None, got 0"),
])
def test_bad_prefix_settings_name_the_field(kwargs, message):
    with pytest.raises(ValueError) as info:
        LoraConfig(**kwargs)
    assert message in str(info.value)
