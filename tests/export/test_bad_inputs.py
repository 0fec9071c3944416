"""Bad inputs to export / import: a clear ConversionError naming the file and the key or field,
raised before anything is written (no output folder, no partial folder left behind)."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_lora.convert.errors import ConversionError
from megatron_lora.export.from_peft import import_peft
from megatron_lora.export.to_peft import export_peft
from tests.convert.tiny import make_tiny_mixtral
from tests.export import _support as S

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


@pytest.fixture(scope="module")
def good_peft(tiny, tmp_path_factory):
    """A small valid PEFT adapter (q_proj, o_proj, gate) made by PEFT for the tiny model."""
    from peft import LoraConfig, get_peft_model

    out = str(tmp_path_factory.mktemp("bad_inputs") / "peft")
    torch.manual_seed(0)
    model = get_peft_model(S.hf_model(tiny["hf"]), LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "o_proj", "gate"], init_lora_weights=False))
    model.save_pretrained(out)
    return out


def _copy(src, tmp_path):
    dst = str(tmp_path / "adapter")
    shutil.copytree(src, dst)
    return dst


def _edit_config(directory, **changes):
    path = os.path.join(directory, CONFIG)
    cfg = json.load(open(path))
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    json.dump(cfg, open(path, "w"))


def _assert_import_fails(adapter, tmp_path, hf, *needles):
    save = tmp_path / "out"
    with pytest.raises(ConversionError) as info:
        import_peft(adapter, str(save), hf_config=hf)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    assert not save.exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".out.partial")]
    return str(info.value)


def test_good_adapter_imports(good_peft, tiny, tmp_path):
    report = import_peft(good_peft, str(tmp_path / "ok"), hf_config=tiny["hf"])
    assert report["ranks"] == {"linear_qkv": 2, "linear_proj": 2, "router": 2}


@pytest.mark.parametrize("field", ["r", "lora_alpha", "peft_type"])
def test_missing_config_field(good_peft, tiny, tmp_path, field):
    adapter = _copy(good_peft, tmp_path)
    _edit_config(adapter, **{field: None})
    _assert_import_fails(adapter, tmp_path, tiny["hf"], CONFIG, repr(field))


@pytest.mark.parametrize("change,needle", [
    ({"use_dora": True}, "DoRA"),
    ({"lora_bias": True}, "lora_bias"),
    ({"bias": "all"}, "bias"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"auto_mapping": {"base_model_class": "LlamaForCausalLM"}}, "LlamaForCausalLM"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
])
def test_unsupported_peft_features(good_peft, tiny, tmp_path, change, needle):
    adapter = _copy(good_peft, tmp_path)
    _edit_config(adapter, **change)
    _assert_import_fails(adapter, tmp_path, tiny["hf"], CONFIG, needle)


def test_adapter_for_another_shape(good_peft, tiny, tmp_path):
    other = str(tmp_path / "wide")
    make_tiny_mixtral(other, hidden_size=96)
    msg = _assert_import_fails(good_peft, tmp_path, other, WEIGHTS, "layers.0.", "lora_A.weight")
    assert "shape" in msg


def test_adapter_with_more_layers_than_the_model(good_peft, tiny, tmp_path):
    other = str(tmp_path / "shallow")
    make_tiny_mixtral(other, num_hidden_layers=2)
    _assert_import_fails(good_peft, tmp_path, other, WEIGHTS, "model.layers.2.")


def test_unknown_key_and_dora_magnitude(good_peft, tiny, tmp_path):
    adapter = _copy(good_peft, tmp_path)
    path = os.path.join(adapter, WEIGHTS)
    tensors = load_file(path)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    tensors[key] = torch.ones(64)
    save_file(tensors, path)
    _assert_import_fails(adapter, tmp_path, tiny["hf"], WEIGHTS, key)


def test_rank_disagrees_with_config(good_peft, tiny, tmp_path):
    adapter = _copy(good_peft, tmp_path)
    _edit_config(adapter, rank_pattern={"o_proj": 3})
    _assert_import_fails(adapter, tmp_path, tiny["hf"], WEIGHTS, "o_proj", "rank 3")


def test_truncated_safetensors(good_peft, tiny, tmp_path):
    adapter = _copy(good_peft, tmp_path)
    path = os.path.join(adapter, WEIGHTS)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    _assert_import_fails(adapter, tmp_path, tiny["hf"], WEIGHTS, "truncated")


def test_missing_weights_file(good_peft, tiny, tmp_path):
    adapter = _copy(good_peft, tmp_path)
    os.remove(os.path.join(adapter, WEIGHTS))
    _assert_import_fails(adapter, tmp_path, tiny["hf"], WEIGHTS, "not found")


def test_cli_exit_code_and_message(good_peft, tiny, tmp_path):
    adapter = _copy(good_peft, tmp_path)
    _edit_config(adapter, use_dora=True)
    proc = S.cli("import", "peft", "--adapter", adapter, "--load-hf", tiny["hf"],
                 "--save", str(tmp_path / "out"))
    assert proc.returncode == 2 and "DoRA" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_export_with_the_wrong_model_config(good_peft, tiny, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    import_peft(good_peft, ckpt, hf_config=tiny["hf"])
    other = str(tmp_path / "wide")
    make_tiny_mixtral(other, hidden_size=96)
    with pytest.raises(ConversionError) as info:  # the base the import recorded differs
        export_peft(ckpt, str(tmp_path / "out"), hf_config=other)
    assert "(differing: hidden_size, head_dim)" in str(info.value)
    with pytest.raises(ConversionError) as info:  # told it is intended: the shapes still differ
        export_peft(ckpt, str(tmp_path / "out"), hf_config=other, allow_other_base=True)
    assert "decoder.layers.self_attention.linear_qkv.lora_A" in str(info.value)
    assert not (tmp_path / "out").exists()


def test_export_of_a_folder_that_is_no_checkpoint(tiny, tmp_path):
    with pytest.raises(ConversionError) as info:
        export_peft(tiny["hf"], str(tmp_path / "out"), hf_config=tiny["hf"])
    assert tiny["hf"] in str(info.value)
    assert not (tmp_path / "out").exists()
