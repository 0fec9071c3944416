"""NaN / inf weights and unusable FP8 / MXFP4 scales are refused when the tensor is read, naming
the file, the tensor and the element or block (convert/finite.py); before, they converted,
loaded and trained into NaN logits and a NaN loss with exit 0."""

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_lora.convert import fp8, mxfp4
from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.hf_files import HFCheckpoint
from tests.convert.test_fp8 import _pair, fp8_mixtral  # noqa: F401 (a fixture)

BLOCK = (128, 128)


def _finite_pair(seed=1):
    """test_fp8's random codes (no NaN code) as uint8, and their scales."""
    q, s = _pair((300, 260), BLOCK, seed=seed, finite=True)
    return q.view(torch.uint8).clone(), s


def _view(tmp_path, q, s, extra=None):
    save_file({"w.weight": q, "w.weight_scale_inv": s, **(extra or {})},
              str(tmp_path / "model.safetensors"))
    return fp8.FP8Checkpoint(HFCheckpoint(str(tmp_path)), {"w.weight": "w.weight_scale_inv"},
                             BLOCK, torch.bfloat16)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, 0.0],
                         ids=["nan", "inf", "negative", "zero"])
def test_a_bad_block_scale_is_refused_naming_the_tensor_and_block(tmp_path, value):
    codes, s = _finite_pair()
    s[2, 1] = value  # rows 256..299, columns 128..255
    view = _view(tmp_path, codes.view(torch.float8_e4m3fn), s)
    path = tmp_path / "model.safetensors"
    what = ("non-finite value" if value != value or value == float("inf") else
            "block scale(s) that are not positive finite")
    with pytest.raises(ConversionError, match=re.escape(f"{path}: tensor 'w.weight_scale_inv' "
                                                        f"holds 1 {what}")) as err:
        view.read("w.weight")
    assert "[2, 1]" in str(err.value), str(err.value)
    # a box outside the bad block still reads; one inside is refused, naming the whole index
    assert view.read("w.weight", (slice(0, 128), slice(0, 260))).shape == (128, 260)
    with pytest.raises(ConversionError, match=r"index \[2, 1\]"):
        view.read("w.weight", (slice(290, 300), slice(200, 201)))


def test_a_finite_scale_whose_product_overflows_is_refused(tmp_path):
    codes, s = _finite_pair()
    codes[200, 130] = 0x7E  # 448, the largest e4m3fn value: 448 x 1e38 overflows to inf
    s[1, 1] = 1e38
    view = _view(tmp_path, codes.view(torch.float8_e4m3fn), s)
    with pytest.raises(ConversionError, match=r"tensor 'w.weight \(dequantised\)' holds \d+ "
                                              r"non-finite value\(s\) in the part read \(first: "
                                              r"inf at index \[\d+, \d+\]"):
        view.read("w.weight", (slice(130, 250), slice(100, 200)))


def test_a_nan_fp8_weight_and_a_nan_or_inf_plain_weight_are_refused(tmp_path):
    codes, s = _finite_pair()
    codes[131, 7] = 0xFF  # e4m3fn's -NaN
    norm = torch.ones(5)
    norm[3] = float("-inf")
    view = _view(tmp_path, codes.view(torch.float8_e4m3fn), s, {"n.weight": norm})
    with pytest.raises(ConversionError, match=r"tensor 'w.weight' holds 1 non-finite value\(s\) "
                                              r"in the part read \(first: nan at index \[131, 7\]"):
        view.read("w.weight")
    assert view.read("w.weight", (slice(0, 128),)).shape == (128, 260)
    with pytest.raises(ConversionError, match=r"'n.weight' holds 1 non-finite value\(s\) in the "
                                              r"part read \(first: -inf at index \[3\]"):
        view.read("n.weight")


def test_an_mxfp4_scale_of_255_is_refused_naming_expert_row_and_group(tmp_path):
    name = "model.layers.0.mlp.experts.down_proj"
    blocks = torch.zeros(2, 4, 3, 16, dtype=torch.uint8)
    scales = torch.full((2, 4, 3), 127, dtype=torch.uint8)
    scales[1, 2, 1] = 255
    save_file({f"{name}_blocks": blocks, f"{name}_scales": scales},
              str(tmp_path / "model.safetensors"))
    ckpt = HFCheckpoint(str(tmp_path))
    assert torch.equal(mxfp4.read_expert(ckpt, name, 0), torch.zeros(4, 96, dtype=torch.bfloat16))
    with pytest.raises(ConversionError, match=rf"model.safetensors: tensor {name}_scales holds 1 "
                       r"scale\(s\) of 255 \(E8M0's NaN\) for expert 1 \(first: row 2, group 1: "
                       r"values 32..63\)"):
        mxfp4.read_expert(ckpt, name, 1)


def test_convert_of_an_fp8_folder_with_a_nan_scale_exits_2_without_output(fp8_mixtral,  # noqa
                                                                          tmp_path, capsys):
    from megatron_lora.cli import main

    bad = str(tmp_path / "bad")
    shutil.copytree(fp8_mixtral["fp8"], bad)
    index = json.load(open(os.path.join(bad, "model.safetensors.index.json")))
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight_scale_inv"
    shard = os.path.join(bad, index["weight_map"][name])
    tensors = load_file(shard)
    tensors[name][1, 0] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    out = str(tmp_path / "out")
    assert main(["convert", "hf-to-mcore", "--hf-dir", bad, "--save", out, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{shard}: tensor '{name}' holds 1 non-finite value(s)" in err, err
    assert "index [1, 0]" in err and "Traceback" not in err and not os.path.exists(out), err


@pytest.mark.parametrize("nproc", [1, 2], ids=["1 rank", "TP2"])
def test_logits_of_a_folder_with_a_nan_weight_exit_non_zero_naming_it(tmp_path, nproc):
    """`logits --load-hf` reads the weights while the model is built: the rank that reads the
    NaN stops with the message (at TP2 torchrun then stops the other rank), no logits file."""
    from tests.convert.tiny import make_tiny_mixtral
    from tests.export import _support as S

    hf = str(tmp_path / "hf")
    make_tiny_mixtral(hf, num_hidden_layers=2)
    index = json.load(open(os.path.join(hf, "model.safetensors.index.json")))
    name = "model.layers.1.self_attn.o_proj.weight"
    shard = os.path.join(hf, index["weight_map"][name])
    tensors = load_file(shard)
    tensors[name][5, 9] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    tokens = S.write_tokens(str(tmp_path / "tokens.json"), torch.tensor([[1, 2, 3, 4]]))
    out = str(tmp_path / "logits.safetensors")
    args = ["logits", "--load-hf", hf, "--tokens", tokens, "--out", out]
    proc = S.cli(*args, *(["--tensor-model-parallel-size", "2", "--sequence-parallel"]
                          if nproc == 2 else []),
                 nproc=nproc)
    assert proc.returncode != 0 and not os.path.exists(out), proc.stderr[-2000:]
    assert f"{shard}: tensor '{name}' holds 1 non-finite value(s) in the part read (first: nan " \
           f"at index [5, 9])" in proc.stderr, proc.stderr[-2000:]
    if nproc == 1:  # (at TP2, torchrun reports the stopped ranks with its own traceback)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
