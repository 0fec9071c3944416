"""Fine-grained FP8 dequantisation (convert/fp8.py) against transformers 5.24's own code, bit for
bit.

The FP8 tensors and scales are made here: every float8_e4m3fn bit pattern (NaNs, zeros of both
signs, subnormals, +-448), scales spread over many binades. Where M and N are multiples of the
block, ours equals transformers' on-load `Fp8Dequantize._dequantize_one`; with edge blocks
(300 x 260 at 128 x 128, stacks at 32 x 32), transformers' `_dequantize_fp8_weight` with an fp32
product (the on-load function derives the block from the scale grid, which is wrong there). Boxes
read through `FP8Checkpoint` (what a TP rank reads) equal the same box of the whole tensor.
Bad folders and configs are refused naming the tensor and the config field.
"""

import importlib.util
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

from megatron_lora.convert import fp8
from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.hf_files import HFCheckpoint
from megatron_lora.testing import compare

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]


def tool():
    """tools/make_fp8_example.py (the quantiser for the test folders and the docs)."""
    spec = importlib.util.spec_from_file_location(
        "make_fp8_example", os.path.join(ROOT, "tools", "make_fp8_example.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pair(shape, block, seed=0, scale_dtype=torch.float32, finite=False):
    """Random FP8 codes (all 256 patterns appear when there is room; finite: the two NaN codes
    S.1111.111 replaced by S.1111.110, as a checkpoint read through HFCheckpoint must be) and
    scales over many binades."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    n = min(codes.numel(), 256)
    codes.view(-1)[:n] = torch.arange(256, dtype=torch.uint8)[torch.randperm(256, generator=g)[:n]]
    if finite:
        codes[(codes & 0x7F) == 0x7F] -= 1
    exps = torch.randint(-20, 6, fp8.scale_shape(shape, block), generator=g).to(torch.float32)
    mant = torch.rand(exps.shape, generator=g) + 0.5
    return codes.view(torch.float8_e4m3fn), (mant * torch.exp2(exps)).to(scale_dtype)


def _bits(t):
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _same_bits(got, want, what):
    """Bit for bit; else fail naming the worst element (NaN codes equal where both are NaN)."""
    if not torch.equal(_bits(got), _bits(want)):
        compare.assert_within(got, want, 0, what)
        raise AssertionError(f"{what}: equal values, other bits (the sign of a zero)")


def _theirs_edge(q, s, block, dtype):
    """transformers' block layout with the configured block, its product in fp32."""
    return _dequantize_fp8_weight(q.clone(), s, list(block), torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((3, 64, 96), (32, 32))],
                         ids=["256x384@128", "3x64x96@32"])
def test_block_multiples_equal_transformers_on_load_bit_for_bit(shape, block, dtype):
    q, s = _pair(shape, block)
    theirs = Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=dtype)
    ours = fp8.dequantize(q, s, block, dtype, rows_per_chunk=block[0])
    assert ours.dtype == theirs.dtype == dtype and ours.shape == q.shape
    assert torch.isnan(ours).any() and torch.isfinite(ours).sum() > ours.numel() // 2
    assert torch.equal(_bits(ours), _bits(theirs))
    # the check can fail: the product in the output dtype (scale rounded first) differs
    if dtype == torch.bfloat16:
        wrong = (q.to(dtype) * s.to(dtype).repeat_interleave(block[0], -2)
                 .repeat_interleave(block[1], -1)).to(dtype)
        assert not torch.equal(_bits(wrong), _bits(theirs))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,block", [((300, 260), (128, 128)), ((2, 80, 90), (32, 32)),
                                         ((5, 7), (32, 32))], ids=["300x260@128", "2x80x90@32",
                                                                   "5x7@32"])
def test_edge_blocks_equal_transformers_bit_for_bit(shape, block, dtype):
    q, s = _pair(shape, block, seed=1)
    ours = fp8.dequantize(q, s, block, dtype, rows_per_chunk=block[0])
    assert torch.equal(_bits(ours), _bits(_theirs_edge(q, s, block, dtype)))
    assert torch.equal(_bits(ours), _bits(fp8.dequantize(q, s, block, dtype)))  # one chunk
    # the check can fail: one edge scale changed changes the result
    s2 = s.clone()
    s2[..., -1, -1] *= 2
    assert not torch.equal(_bits(ours), _bits(_theirs_edge(q, s2, block, dtype)))


@pytest.mark.parametrize("shape,block", [((300, 256), (128, 128)), ((2, 80, 90), (32, 32))],
                         ids=["300x256@128", "2x80x90@32"])
def test_row_chunks_that_are_not_block_multiples_change_nothing(shape, block):
    """Chunks of 1, 48, 100, 129 and 200 rows (rounded down to whole blocks, so that a chunk never
    starts inside a block whose scale row it would miss) give transformers' result bit for bit;
    several chunks per tensor, the last one partial, as the edge blocks are."""
    q, s = _pair(shape, block, seed=3)
    want = _theirs_edge(q, s, block, torch.bfloat16)
    for rows in (1, 48, 100, 129, 200):
        got = fp8.dequantize(q, s, block, torch.bfloat16, rows_per_chunk=rows)
        _same_bits(got, want, f"{list(shape)} in chunks of {rows} rows")


def test_checkpoint_reads_in_several_default_chunks(tmp_path, monkeypatch):
    """FP8Checkpoint.read's default chunk (CHUNK_BYTES of fp32) made 100 rows of a 300 x 256
    tensor: the whole tensor and boxes read in several chunks equal transformers' result."""
    block, shape = (128, 128), (300, 256)
    q, s = _pair(shape, block, seed=4, finite=True)
    save_file({"w.weight": q, "w.weight_scale_inv": s}, str(tmp_path / "model.safetensors"))
    view = fp8.FP8Checkpoint(HFCheckpoint(str(tmp_path)), {"w.weight": "w.weight_scale_inv"},
                             block, torch.float32)
    monkeypatch.setattr(fp8, "CHUNK_BYTES", 4 * shape[1] * 100)  # 100 rows: not whole blocks
    whole = _theirs_edge(q, s, block, torch.float32)
    for rows in (slice(None), slice(5, 290), slice(100, 300)):
        box = view.read("w.weight", (rows,))
        _same_bits(box, whole[rows], f"rows {rows} read in chunks of 100 rows")


def test_a_box_reads_only_its_blocks_and_equals_the_whole(tmp_path):
    block, shape = (128, 128), (300, 260)
    q, s = _pair(shape, block, seed=2, scale_dtype=torch.bfloat16, finite=True)
    save_file({"w.weight": q, "w.weight_scale_inv": s, "n.weight": torch.ones(3)},
              str(tmp_path / "model.safetensors"))
    ckpt = HFCheckpoint(str(tmp_path))
    view = fp8.FP8Checkpoint(ckpt, {"w.weight": "w.weight_scale_inv"}, block, torch.bfloat16)
    assert set(view.tensors) == {"w.weight", "n.weight"}
    info = view.tensors["w.weight"]
    assert info.dtype == torch.bfloat16 and info.shape == shape
    whole = _theirs_edge(q, s, block, torch.bfloat16)
    assert torch.equal(_bits(view.read("w.weight")), _bits(whole))
    for rows, cols in [(slice(5, 290), slice(130, 131)), (slice(128, 256), slice(0, 260)),
                       (slice(150, 300), slice(255, 260)), (slice(0, 1), slice(0, 129))]:
        box = view.read("w.weight", (rows, cols))
        assert box.is_contiguous() and torch.equal(_bits(box), _bits(whole[rows, cols]))
    assert torch.equal(view.read("n.weight"), torch.ones(3))


def test_the_example_quantiser_round_trips_within_fp8_precision():
    w = torch.randn(70, 45) * torch.logspace(-3, 1, 45)
    w[:32, :32] = 0  # a zero block keeps scale 1
    q, s = tool().quantize(w, (32, 32))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2) and s[0, 0] == 1
    back = fp8.dequantize(q, s, (32, 32), torch.float32)
    assert torch.all((back - w).abs() <= 2 ** -4 * w.abs().amax() + 1e-30)


@pytest.mark.parametrize("change,message", [
    ({"quant_method": "gptq"}, "quantization_config.quant_method='gptq' is not supported"),
    ({"fmt": "e5m2"}, "quantization_config fmt='e5m2' (only 'e4m3'"),
    ({"activation_scheme": "static"}, "activation_scheme='static' (only 'dynamic'"),
    ({"weight_block_size": None}, "weight_block_size=None (must be two positive integers"),
    ({"weight_block_size": [128]}, "weight_block_size=[128]"),
    ({"expert_dtype": "fp4"}, "expert_dtype='fp4'"),
    ({"scale_fmt": "e4m3"}, "scale_fmt='e4m3'"),
])
def test_unsupported_configs_are_refused_naming_the_field(change, message):
    q = dict({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}, **change)
    with pytest.raises(ConversionError) as err:
        fp8.read_format({"quantization_config": q}, "/m/config.json")
    assert str(err.value).startswith("/m/config.json: ") and message in str(err.value), err.value


def test_formats_read():
    assert fp8.read_format({}, "c") is None
    assert fp8.read_format({"quantization_config": {"quant_method": "mxfp4"}}, "c") is None
    default = {"quantization_config": {"quant_method": "fp8"}}
    assert fp8.read_format(default, "c").block == (128, 128)
    ue8m0 = {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [64, 32]}
    assert fp8.read_format({"quantization_config": ue8m0}, "c").block == (64, 32)
    cfg = {"hidden_size": 8, "quantization_config": ue8m0}
    assert fp8.dequantised_config(cfg) == {"hidden_size": 8} and "quantization_config" in cfg
    mx = {"quantization_config": {"quant_method": "mxfp4"}}
    assert fp8.dequantised_config(mx) == {}
    other = {"quantization_config": {"quant_method": "bitsandbytes"}}
    assert fp8.dequantised_config(other) is other


def _folder(tmp_path, tensors, quantization=True):
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    save_file(tensors, str(d / "model.safetensors"))
    return HFCheckpoint(str(d)), fp8.FP8Format((128, 128)) if quantization else None


def test_bad_pairs_are_refused_naming_the_tensor(tmp_path):
    q, s = _pair((300, 260), (128, 128))
    cases = [
        ({"a.weight": q}, True, "tensor 'a.weight' is float8_e4m3fn but 'a.weight_scale_inv' "
                                "is missing"),
        ({"a.weight": q, "a.weight_scale_inv": s[:2]}, True,
         r"'a.weight_scale_inv' has shape \[2, 3\] and dtype torch.float32, but 'a.weight' "
         r"\[300, 260\] with config.json quantization_config.weight_block_size \[128, 128\] "
         r"implies \[3, 3\]"),
        ({"a.weight": q, "a.weight_scale_inv": s.to(torch.float64)}, True, "dtype torch.float64"),
        ({"a.weight": q, "a.weight_scale_inv": s}, False,
         "'a.weight' is float8_e4m3fn but config.json has no quantization_config with "
         "quant_method 'fp8'"),
        ({"a.weight": q.to(torch.float8_e5m2), "a.weight_scale_inv": s}, True,
         "'a.weight' is torch.float8_e5m2; only float8_e4m3fn"),
        ({"a.weight": torch.zeros(2, 2), "a.weight_scale_inv": s}, True,
         "'a.weight_scale_inv' is a block scale, but 'a.weight' is torch.float32"),
        ({"a.weight_scale_inv": s}, True, "but 'a.weight' is missing"),
    ]
    for tensors, quantization, message in cases:
        ckpt, fmt = _folder(tmp_path, tensors, quantization)
        with pytest.raises(ConversionError, match=message):
            fp8.quantized_weights(ckpt, fmt, "config.json")
    ckpt, fmt = _folder(tmp_path, {"a.weight": q, "a.weight_scale_inv": s, "b": s.clone()})
    assert fp8.quantized_weights(ckpt, fmt, "config.json") == {"a.weight": "a.weight_scale_inv"}
    with pytest.raises(ConversionError, match=r"not a float8_e4m3fn weight with its 128x128"):
        fp8.dequantize(q, s[:, :2])


# ---- a tiny Mixtral whose linears are FP8 blocks, against transformers on the dequantised copy

from megatron_lora.runtime import ParallelLayout  # noqa: E402
from tests.export import _support as S  # noqa: E402
from tests.families import _support as F  # noqa: E402
from tests.harness import multirank  # noqa: E402

BLOCK = (32, 32)
CONFIG = dict(vocab_size=250, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
              num_experts_per_tok=2, max_position_embeddings=128, rope_theta=1e6,
              rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.1)


def _dequantised_copy(src: str, out: str) -> None:
    """`src` (FP8) with every pair dequantised by transformers' code into bf16, config.json
    without its quantization_config."""
    os.makedirs(out)
    tensors = {}
    for name in sorted(os.listdir(src)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, name)))
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        weight = name[: -len("_scale_inv")]
        tensors[weight] = _theirs_edge(tensors[weight], tensors.pop(name), BLOCK, torch.bfloat16)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(src, "config.json")))
    del config["quantization_config"]
    json.dump(config, open(os.path.join(out, "config.json"), "w"))


@pytest.fixture(scope="module")
def fp8_mixtral(tmp_path_factory):
    """bf16 tiny Mixtral (w1/w3 80 rows, w2 80 columns: edge blocks at 32 x 32), its FP8 copy,
    transformers' dequantised copy of that, and transformers' logits on the dequantised copy."""
    from transformers import MixtralConfig, MixtralForCausalLM

    root = str(tmp_path_factory.mktemp("fp8"))
    paths = {k: os.path.join(root, k) for k in ("bf16", "fp8", "deq")}
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**CONFIG))
    F.perturb_norms(model)
    model.to(torch.bfloat16).save_pretrained(paths["bf16"], max_shard_size="100KB")
    tool().make_fp8(paths["bf16"], paths["fp8"], BLOCK)
    _dequantised_copy(paths["fp8"], paths["deq"])
    tokens = F.make_tokens(batch=2, seq=12, vocab=250)
    paths["reference"] = os.path.join(root, "reference.safetensors")
    save_file({"tokens": tokens, "deq": F.hf_logits(paths["deq"], tokens).contiguous(),
               "deq" + F.FP64: F.hf_logits(paths["deq"], tokens, dtype=torch.float64).contiguous()},
              paths["reference"])
    return paths


def _torch_dist_tensors(directory):
    from megatron_lora.convert.dcp_read import TorchDistCheckpoint

    ckpt = TorchDistCheckpoint(directory)
    return {k: ckpt.read(k, (0,) * len(m.size), tuple(m.size)) for k, m in ckpt.tensors.items()}


def test_fp8_folder_converts_to_the_checkpoint_of_its_dequantised_copy(fp8_mixtral, tmp_path):
    from megatron_lora.convert.hf_to_mcore import hf_to_mcore
    from megatron_lora.convert.mcore_to_hf import mcore_to_hf
    from tests.convert.test_roundtrip import assert_bit_identical, read_hf_tensors

    files = read_hf_tensors(fp8_mixtral["fp8"])
    w1 = "model.layers.1.block_sparse_moe.experts.3.w1.weight"
    assert files[w1].dtype == torch.float8_e4m3fn and files[w1 + "_scale_inv"].shape == (3, 2)
    out = {k: str(tmp_path / k) for k in ("fp8", "deq", "back")}
    for k in ("fp8", "deq"):
        hf_to_mcore(fp8_mixtral[k], out[k], progress=False)
    ours, theirs = _torch_dist_tensors(out["fp8"]), _torch_dist_tensors(out["deq"])
    assert_bit_identical(ours, theirs)
    assert ours["decoder.layers.mlp.experts.experts.linear_fc1.weight"].dtype == torch.bfloat16
    for name in ("hf_config.json", "megatron_lora.json"):
        assert open(os.path.join(out["fp8"], name)).read() == \
            open(os.path.join(out["deq"], name)).read(), name
    mcore_to_hf(out["fp8"], out["back"], progress=False)
    assert_bit_identical(read_hf_tensors(out["back"]), read_hf_tensors(fp8_mixtral["deq"]))
    assert "quantization_config" not in json.load(open(os.path.join(out["back"], "config.json")))
    # an FP8 config given to mcore-to-hf is written without its quantization_config too
    mcore_to_hf(out["fp8"], out["back"], progress=False, overwrite=True,
                hf_config=os.path.join(fp8_mixtral["fp8"], "config.json"))
    assert "quantization_config" not in json.load(open(os.path.join(out["back"], "config.json")))


def test_a_bad_fp8_folder_is_refused_before_any_work(fp8_mixtral, tmp_path, capsys):
    import shutil

    from megatron_lora.cli import main
    from megatron_lora.convert.hf_to_mcore import open_hf

    bad = str(tmp_path / "bad")
    shutil.copytree(fp8_mixtral["fp8"], bad)
    index = json.load(open(os.path.join(bad, "model.safetensors.index.json")))
    name = "model.layers.0.self_attn.k_proj.weight_scale_inv"
    shard = os.path.join(bad, index["weight_map"].pop(name))
    save_file({k: v for k, v in load_file(shard).items() if k != name}, shard)
    json.dump(index, open(os.path.join(bad, "model.safetensors.index.json"), "w"))
    message = f"'{name[:-len('_scale_inv')]}' is float8_e4m3fn but '{name}' is missing"
    with pytest.raises(ConversionError, match=message):
        open_hf(bad)
    out = str(tmp_path / "out")
    assert main(["convert", "hf-to-mcore", "--hf-dir", bad, "--save", out, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and not os.path.exists(out), err
    config = json.load(open(os.path.join(fp8_mixtral["fp8"], "config.json")))
    config["quantization_config"]["activation_scheme"] = "static"
    json.dump(config, open(os.path.join(bad, "config.json"), "w"))
    with pytest.raises(ConversionError, match=r"bad/config.json: quantization_config "
                                              r"activation_scheme='static' \(only 'dynamic'"):
        open_hf(bad)


@pytest.mark.parametrize("layout", [pytest.param(ParallelLayout(tp=2, sp=True), id="TP2+SP")])
@multirank(world_size=2, timeout=600)
def test_load_hf_of_the_fp8_folder_gives_transformers_logits(layout, fp8_mixtral):
    """At TP2 (ETP2) each rank reads half the rows of w1/w3 (40 of 80: a block cut in two), of
    the fused QKV, and half the columns of o_proj/w2: the FP8 folder and the dequantised copy
    give the same logits, within compare.reference_bound of transformers' on the dequantised
    copy (11 x its own fp32 rounding, measured against its fp64 evaluation)."""
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf
    from megatron_lora.convert.logits import forward_logits
    from megatron_lora.models.build import build_model, model_config
    from megatron_lora.testing import parity

    ref = load_file(fp8_mixtral["reference"])
    got = {}
    for name in ("fp8", "deq"):
        info, hf, dtype = open_hf(fp8_mixtral[name])
        assert dtype == torch.bfloat16
        model = build_model(info, model_config(info, layout))
        load_hf(model, info, hf)
        got[name] = forward_logits(model, ref["tokens"], info.vocab_size)
    if parity.assert_held_by(got["fp8"], 1, "the logits"):
        assert torch.equal(got["fp8"], got["deq"])
        S.assert_near_reference(got["fp8"], F.reference(ref, "deq"),
                                "FP8 folder at TP2+SP vs transformers on its dequantised copy")
