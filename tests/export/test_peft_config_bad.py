"""A broken adapter_config.json (nesting, bytes, field types) is a ConversionError naming the file
and the field, never a RecursionError or TypeError traceback."""

import json
import os

import pytest

from megatron_lora.convert.errors import ConversionError
from megatron_lora.export.peft_config import CONFIG_NAME, read_adapter_config

GOOD = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "gate"],
        "rank_pattern": {"gate": 1}, "alpha_pattern": {}, "use_rslora": False}


def _write(tmp_path, content):
    path = tmp_path / CONFIG_NAME
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return str(tmp_path), str(path)


def _fails(tmp_path, content) -> str:
    directory, path = _write(tmp_path, content)
    with pytest.raises(ConversionError) as info:
        read_adapter_config(directory)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and msg.count(path) == 1, msg
    return msg[len(path) + 2:]


def test_good_config_reads(tmp_path):
    directory, path = _write(tmp_path, GOOD)
    cfg = read_adapter_config(directory)
    assert (cfg.r, cfg.lora_alpha, cfg.target_modules, cfg.rank_pattern, cfg.path) == (
        2, 4.0, ("q_proj", "gate"), {"gate": 1}, path)


def test_deeply_nested_adapter_config(tmp_path):
    deep = b'{"peft_type": "LORA", "target_modules": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    assert _fails(tmp_path, deep).startswith("JSON nested too deeply")


def test_nested_value_in_a_field(tmp_path):
    nested = json.loads("[" * 50 + "]" * 50)
    assert _fails(tmp_path, dict(GOOD, target_modules=[nested])) == (
        "field target_modules must be a list of module names, got an array [[[[...]]]]")


def test_non_utf8_adapter_config(tmp_path):
    text = json.dumps(GOOD).replace("q_proj", "q_pr\xf6j").encode("latin-1")
    assert _fails(tmp_path, text).startswith("not UTF-8 (byte 0xf6 at column")


@pytest.mark.parametrize("change,message", [
    (dict(rank_pattern={"gate": "1"}),
     'field rank_pattern["gate"] must be a positive integer, got the string "1"'),
    (dict(rank_pattern={"gate": True}), 'field rank_pattern["gate"] must be a positive integer, '
                                        "got true"),
    (dict(alpha_pattern={"gate": float("nan")}),
     'field alpha_pattern["gate"] must be a number, got NaN'),
    (dict(rank_pattern=[1]), "field rank_pattern must be an object, got an array [1]"),
    (dict(use_rslora="yes"), 'field use_rslora must be true or false, got the string "yes"'),
    (dict(lora_alpha=float("inf")), "field lora_alpha must be a positive number, got Infinity"),
    (dict(r=2.0), "field r must be a positive integer, got 2.0"),
    (dict(target_modules={"q_proj": 1}), "field target_modules must be a list of module names"),
])
def test_wrong_field_types(tmp_path, change, message):
    assert _fails(tmp_path, dict(GOOD, **change)).startswith(message)


def test_unreadable_file_reason_is_not_the_path_again(tmp_path):
    os.mkdir(tmp_path / CONFIG_NAME)
    path = str(tmp_path / CONFIG_NAME)
    with pytest.raises(ConversionError) as info:
        read_adapter_config(str(tmp_path))
    assert str(info.value) == f"{path}: cannot read: Is a directory"


def test_base_checkpoint_given_as_adapter_names_common_pt_once(tiny):
    """A torch_dist checkpoint without run metadata (a converted base model) is not an adapter:
    the message names its common.pt once and says why."""
    from megatron_lora.export.adapter_ckpt import AdapterCheckpoint
    from megatron_lora.families import read_hf_config

    with pytest.raises(ConversionError) as info:
        AdapterCheckpoint(tiny["mcore"], read_hf_config(tiny["hf"]))
    common = os.path.join(tiny["mcore"], "common.pt")
    assert str(info.value) == f"{common}: has no 'common' dict: not an adapter checkpoint"
