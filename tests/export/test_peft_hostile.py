"""`import peft` with hostile adapters: files symlinked out of the adapter folder, NaN / Inf
tensors, and target_modules naming modules the model does not have are refused with a
ConversionError naming the file and the key or target, before anything is written."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_lora.convert.errors import ConversionError
from megatron_lora.export.from_peft import import_peft
from tests.export import _support as S

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


@pytest.fixture(scope="module")
def good_peft(tiny, tmp_path_factory):
    """A small valid PEFT adapter (q_proj, o_proj, gate) made by PEFT for the tiny model."""
    from peft import LoraConfig, get_peft_model

    out = str(tmp_path_factory.mktemp("hostile_peft") / "peft")
    torch.manual_seed(0)
    model = get_peft_model(S.hf_model(tiny["hf"]), LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "o_proj", "gate"], init_lora_weights=False))
    model.save_pretrained(out)
    return out


def _copy(src, tmp_path):
    dst = str(tmp_path / "adapter")
    shutil.copytree(src, dst)
    return dst


def _fails(adapter, tmp_path, hf, *needles):
    save = tmp_path / "out"
    with pytest.raises(ConversionError) as info:
        import_peft(adapter, str(save), hf_config=hf)
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    assert not save.exists()
    return message


@pytest.mark.parametrize("name", [WEIGHTS, CONFIG])
def test_adapter_file_symlinked_out_is_refused(good_peft, tiny, tmp_path, name):
    adapter = _copy(good_peft, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.move(os.path.join(adapter, name), outside / name)  # a valid file, but elsewhere
    os.symlink(outside / name, os.path.join(adapter, name))
    _fails(adapter, tmp_path, tiny["hf"],
           f"{os.path.join(adapter, name)} resolves to {outside / name}, outside the folder "
           f"{adapter}")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_tensor_is_refused(good_peft, tiny, tmp_path, value):
    adapter = _copy(good_peft, tmp_path)
    path = os.path.join(adapter, WEIGHTS)
    tensors = load_file(path)
    key = sorted(k for k in tensors if k.endswith("o_proj.lora_B.weight"))[0]
    tensors[key][0, 1] = value
    save_file(tensors, path)
    _fails(adapter, tmp_path, tiny["hf"], WEIGHTS, repr(key), "1 NaN or Inf value")


@pytest.mark.parametrize("targets,unknown", [
    (["q_proj", "o_proj", "gate", "qproj"], ["qproj"]),
    (["q_proj", "o_proj", "gate", "mlp.w9", "attn.q_proj"], ["mlp.w9", "attn.q_proj"]),
])
def test_target_modules_the_model_does_not_have(good_peft, tiny, tmp_path, targets, unknown):
    adapter = _copy(good_peft, tmp_path)
    path = os.path.join(adapter, CONFIG)
    config = json.load(open(path))
    config["target_modules"] = targets
    json.dump(config, open(path, "w"))
    _fails(adapter, tmp_path, tiny["hf"], CONFIG, f"target_modules {unknown} match no module")


def test_peft_list_matching():
    from megatron_lora.export.peft_config import unmatched_targets

    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.experts.1.w1", "lm_head"]
    assert unmatched_targets(["q_proj", "self_attn.q_proj", "experts.1.w1", "lm_head",
                              "model.layers.0.self_attn.q_proj"], names) == []
    assert unmatched_targets(["_proj", "proj", "layers", "1.w1x", "head"], names) == [
        "_proj", "proj", "layers", "1.w1x", "head"]


def test_good_adapter_still_imports(good_peft, tiny, tmp_path):
    report = import_peft(good_peft, str(tmp_path / "ok"), hf_config=tiny["hf"])
    assert report["ranks"] == {"linear_qkv": 2, "linear_proj": 2, "router": 2}
