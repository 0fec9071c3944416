"""config.json fields that do not describe the checkpoint, found before any work: a layer or
expert count beyond what the tensor names hold (refused before the expected-tensor table, which
grows with them, is built), DeepSeek-V3 fields left out (transformers' defaults are taken and the
message says so), and a tokenizer.json that is not JSON (refused before it is copied)."""

import json
import os
import shutil

import pytest

from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.hf_to_mcore import hf_to_mcore, open_hf
from tests.convert.tiny import make_tiny_mixtral


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hostile") / "hf")
    make_tiny_mixtral(path, num_hidden_layers=2)
    return path


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    from tests.families.test_deepseek_v3 import make

    path = str(tmp_path_factory.mktemp("hostile_ds") / "hf")
    make(path, num_nextn_predict_layers=0)
    return path


def _copy_with(src: str, dst: str, drop=(), **change) -> str:
    shutil.copytree(src, dst)
    config = json.load(open(os.path.join(dst, "config.json")))
    for name in drop:
        del config[name]
    config.update(change)
    json.dump(config, open(os.path.join(dst, "config.json"), "w"))
    return dst


@pytest.mark.parametrize("layers", [1000, 10 ** 6])
def test_more_layers_than_the_checkpoint_holds_is_refused_before_the_table(mixtral, tmp_path,
                                                                           layers):
    bad = _copy_with(mixtral, str(tmp_path / "bad"), num_hidden_layers=layers)
    with pytest.raises(ConversionError) as err:
        open_hf(bad)  # 10**6 layers: the table alone took ~11 GB and minutes before
    assert str(err.value) == (
        f"{bad}/config.json: num_hidden_layers={layers}, but the checkpoint's tensors in {bad} "
        f"hold layers 0..1 (2 layers) (names model.layers.N....); pass this checkpoint's own "
        f"config.json")


def test_more_experts_than_the_checkpoint_holds_is_refused_before_the_table(mixtral, tmp_path):
    bad = _copy_with(mixtral, str(tmp_path / "bad"), num_local_experts=10 ** 6)
    with pytest.raises(ConversionError, match=r"config.json: num_local_experts=1000000, but the "
                       r"checkpoint's tensors in .* hold experts 0..3 in layer model.layers.0."):
        open_hf(bad)


def test_a_tokenizer_json_that_is_not_json_is_refused_before_it_is_copied(mixtral, tmp_path,
                                                                          capsys):
    from megatron_lora.cli import main

    bad = _copy_with(mixtral, str(tmp_path / "bad"))
    with open(os.path.join(bad, "tokenizer.json"), "w") as f:
        f.write("<html>not found</html>")
    out = str(tmp_path / "out")
    with pytest.raises(ConversionError, match=rf"{bad}/tokenizer.json: not a JSON file \("):
        hf_to_mcore(bad, out, progress=False)
    assert not os.path.exists(out)
    assert main(["convert", "hf-to-mcore", "--hf-dir", bad, "--save", out, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}/tokenizer.json: not a JSON file" in err and "Traceback" not in err, err
    assert not os.path.exists(out)


@pytest.mark.parametrize("field,default", [("q_lora_rank", 1536), ("first_k_dense_replace", 3),
                                           ("kv_lora_rank", 512)])
def test_a_missing_deepseek_field_takes_transformers_default_and_the_error_says_so(
        deepseek, tmp_path, field, default):
    bad = _copy_with(deepseek, str(tmp_path / "bad"), drop=[field])
    with pytest.raises(ConversionError) as err:
        open_hf(bad)
    assert f"config.json does not set {field}: transformers' defaults {field}={default} were " \
           f"taken; set them if they are not this model's" in str(err.value), str(err.value)


def test_the_deepseek_folder_itself_opens(deepseek):
    info, _, _ = open_hf(deepseek)
    assert info.defaulted == () and info.shape.mla.q_lora_rank == 24
