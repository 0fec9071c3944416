"""An NF4 base (models/nf4_model.py) at every layout: logits within 11x transformers' own fp32
rounding (compare.reference_bound) of transformers on a copy of the checkpoint whose decoder
projections were replaced by bitsandbytes' own round trip (each HF tensor, each expert's
matrix on its own), at one rank, PP2xEP2 and TP2xEP2+SP (grouped experts there; the alltoall dispatcher at PP2xEP2), with the ranks holding ~0.516 bytes per frozen decoder parameter; DoRA's
magnitude is the row norm of the dequantised weight (merging onto NF4 and quantising under
adapters are refused); autograd keeps no dequantised weight from
forward to backward (with the Function saving it: [128, 128] and [256, 128] tensors are kept),
and full recomputation of the NF4 layers gives the same gradients (bit for bit). Streamed loading
(convert/load_nf4.py: linears built without weights, each read, quantised and dropped) from HF
and from torch_dist at TP2xEP2+SP and PP2xEP2 gives every tensor of load-then-quantize_base bit
for bit, never holding more than one linear's shard and a stored chunk besides its NF4 model.

The model is the tiny Mixtral of tests/convert widened to 128 (hidden, attention and expert
widths), so that a TP2 / ETP2 shard of a row-parallel linear holds 64 columns: whole blocks."""

import gc
import glob
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing import compare, parity
from tests.convert.tiny import make_tiny_mixtral, make_tokens
from tests.export import _support as S
from tests.harness import multirank

bnbf = pytest.importorskip("bitsandbytes.functional")

WIDE = dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2, vocab_size=128)
QUANTISED = ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")  # not router (gate)


def bnb_round_trip(w):
    q, state = bnbf.quantize_4bit(w.contiguous(), blocksize=64, quant_type="nf4",
                                  compress_statistics=True)
    return bnbf.dequantize_4bit(q, state)


@pytest.fixture(scope="module")
def nf4_mixtral(tmp_path_factory):
    root = tmp_path_factory.mktemp("nf4_mixtral")
    paths = {k: str(root / k) for k in ("hf", "hf_nf4")}
    make_tiny_mixtral(paths["hf"], **WIDE)
    shutil.copytree(paths["hf"], paths["hf_nf4"])
    replaced = 0
    for f in glob.glob(os.path.join(paths["hf_nf4"], "*.safetensors")):
        tensors = load_file(f)
        for name, t in tensors.items():
            if ".layers." in name and name.endswith(QUANTISED):
                tensors[name] = bnb_round_trip(t)
                replaced += 1
        save_file(tensors, f, metadata={"format": "pt"})
    assert replaced == 2 * (4 + 4 * 3)  # per layer q, k, v, o and 4 experts x 3
    tokens = make_tokens(batch=2, seq=8, vocab=128)
    paths["reference"] = str(root / "reference.safetensors")
    nf4 = S.in_both(S.hf_logits, paths["hf_nf4"], tokens)  # fp32, fp64
    save_file({"tokens": tokens, "nf4": nf4[0].contiguous(), "nf4.fp64": nf4[1].contiguous(),
               "full": S.hf_logits(paths["hf"], tokens).contiguous()}, paths["reference"])
    return paths


LAYOUTS = [  # (layout, world size, grouped experts, dispatcher)
    pytest.param(ParallelLayout(), 1, False, "allgather", id="TP1"),
    pytest.param(ParallelLayout(pp=2, ep=2), 4, False, "alltoall", id="PP2xEP2-alltoall"),
    pytest.param(ParallelLayout(tp=2, ep=2, sp=True), 4, True, "allgather",
                 id="TP2xEP2+SP-grouped"),
]


@pytest.mark.parametrize("layout,world_size,grouped,dispatcher", LAYOUTS)
@multirank(world_size=lambda world_size, **_: world_size, timeout=300)
def test_nf4_logits_match_transformers_on_the_round_trip(layout, world_size, grouped,
                                                         dispatcher, nf4_mixtral):
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf
    from megatron_lora.convert.logits import forward_logits
    from megatron_lora.models.build import build_model, model_config
    from megatron_lora.models.nf4_model import nf4_held, quantize_base

    ref = load_file(nf4_mixtral["reference"])
    info, hf, _ = open_hf(nf4_mixtral["hf"])  # the full-precision checkpoint
    model = build_model(info, model_config(info, layout, dispatcher=dispatcher),
                        moe_grouped_gemm=grouped)
    load_hf(model, info, hf)
    converted = quantize_base(model)
    assert converted == 2 * 2 * (1 + 4 // layout.ep) // layout.pp  # attention 2 + experts 2 each
    held, params = nf4_held(model)
    assert 0.5 < held / params <= 0.53, held / params
    for name, p in model.named_parameters():  # no full-precision decoder linear weight is left
        assert not (".decoder." in f".{name}" and "linear_" in name and name.endswith("weight")
                    and "norm" not in name), name
    logits = forward_logits(model, ref["tokens"], info.vocab_size)
    if not parity.assert_held_by(logits, 1, "the logits"):
        return
    # our dequantised weights are the round trip's values (one rounding each at most: within
    # compare.reference_bound's K)
    bound = S.assert_near_reference(logits, (ref["nf4"], ref["nf4.fp64"]),
                                    f"NF4 base at {layout.describe()} vs transformers")
    S.assert_moved(logits, ref["full"], bound, "NF4 quantisation")  # the base really is NF4


@multirank(world_size=1, timeout=300)
def test_dora_magnitude_is_the_dequantised_row_norm(nf4_mixtral, layout=ParallelLayout()):
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.models.build import build_model, model_config
    from megatron_lora.models.nf4_model import quantize_base

    info, hf, _ = open_hf(nf4_mixtral["hf"])
    model = build_model(info, model_config(info, layout))
    load_hf(model, info, hf)
    quantize_base(model)
    adapters = apply_lora(model, LoraConfig(r=4, lora_alpha=8, use_dora=True,
                                            target_modules=["linear_proj"]), verbose=False)
    o_proj = bnb_round_trip(hf.read("model.layers.1.self_attn.o_proj.weight")
                            .float())
    m = adapters["decoder.layers.1.self_attention.linear_proj"].magnitude.detach()
    # each side sums the 128 squares of a row in fp32 and takes the root: within
    # (128 + 1) u / 2 + u of the exact norm relative (Higham eq. 4.4 on a sum of non-negative
    # terms; sqrt halves it), so the two within (128 + 3) u of each other
    want = o_proj.norm(dim=1)
    bound = (o_proj.shape[1] + 3) * compare.unit_roundoff(torch.float32) * want
    compare.assert_within(m, want, bound, "DoRA magnitude vs the dequantised row norm")
    with pytest.raises(ValueError, match="NF4"):
        adapters["decoder.layers.1.self_attention.linear_proj"].merge()
    plain = build_model(info, model_config(info, layout))  # LoRA first, then NF4: refused
    apply_lora(plain, LoraConfig(r=4, lora_alpha=8, target_modules=["linear_qkv"]),
               verbose=False)
    with pytest.raises(ValueError, match="already has a LoRA adapter; quantise the base first"):
        quantize_base(plain)


def _nf4_model(paths, layout, **config):
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf
    from megatron_lora.models.build import build_model, model_config
    from megatron_lora.models.nf4_model import quantize_base

    info, hf, _ = open_hf(paths["hf"])
    model = build_model(info, model_config(info, layout, **config))
    load_hf(model, info, hf)
    quantize_base(model)
    for p in model.parameters():
        p.requires_grad_(False)
    model.embedding.word_embeddings.weight.requires_grad_(True)
    return model


def _loss(model, tokens):
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    return model(tokens, positions, attention_mask=None, labels=tokens).sum()


@multirank(world_size=1, timeout=300)
def test_backward_keeps_no_dequantised_weight(nf4_mixtral, layout=ParallelLayout()):
    """Nothing autograd saves between forward and backward has an NF4 weight's shape: the
    weights are dequantised again in backward (with grads into the embedding, so every linear's
    input gradient is computed); full recomputation gives the same gradient."""
    from megatron_lora.models.nf4_linear import is_nf4

    model = _nf4_model(nf4_mixtral, layout)
    weights = {tuple(m.nf4_codes.shape[:1]) + (m.nf4_codes.shape[1] * 2,)
               for m in model.modules() if is_nf4(m)}
    assert weights == {(256, 128), (128, 128)}  # qkv and fc1; proj and fc2
    params = {p.data_ptr() for p in model.parameters()}  # the output layer's [128, 128] weight
    saved = []

    def pack(t):
        if t.data_ptr() not in params:
            saved.append(tuple(t.shape))
        return t

    tokens = load_file(nf4_mixtral["reference"])["tokens"]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _loss(model, tokens)
    loss.backward()
    assert saved and not weights & set(saved), sorted(weights & set(saved))
    grad = model.embedding.word_embeddings.weight.grad
    assert grad.abs().sum() > 0
    again = _nf4_model(nf4_mixtral, layout, recompute_granularity="full",
                       recompute_method="uniform", recompute_num_layers=1)
    _loss(again, tokens).backward()
    # recomputation runs the same forward ops on the same values again, and backward the same
    # ops in the same order (one CPU process, deterministic kernels): bit for bit
    again_grad = again.embedding.word_embeddings.weight.grad
    assert torch.equal(again_grad, grad), compare.describe(
        "embedding gradient with full recomputation", compare.worst_element(again_grad, grad, 0))


@pytest.fixture(scope="module")
def nf4_mixtral_mcore(nf4_mixtral, tmp_path_factory):
    """The full-precision checkpoint converted to torch_dist (`convert hf-to-mcore`)."""
    from megatron_lora.cli import main

    out = str(tmp_path_factory.mktemp("nf4_mixtral_mcore") / "mcore")
    assert main(["convert", "hf-to-mcore", "--hf-dir", nf4_mixtral["hf"], "--save", out,
                 "--no-progress"]) == 0
    return out


def _live_bytes() -> int:
    """Bytes of the distinct storages of every tensor Python can reach (meta ones hold none)."""
    storages = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and not o.is_meta:
            s = o.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


STREAMED = [  # (layout, grouped experts, dispatcher), all at world 4
    pytest.param(ParallelLayout(tp=2, ep=2, sp=True), True, "allgather", id="TP2xEP2+SP-grouped"),
    pytest.param(ParallelLayout(pp=2, ep=2), False, "alltoall", id="PP2xEP2-alltoall"),
]


@pytest.mark.parametrize("layout,grouped,dispatcher", STREAMED)
@multirank(world_size=4, timeout=300)
def test_streamed_load_holds_one_linear_at_a_time_and_equals_quantize_base(
        layout, grouped, dispatcher, nf4_mixtral, nf4_mixtral_mcore):
    """Built with deferred decoder linears and loaded by load_nf4 from HF safetensors and from
    the torch_dist checkpoint (convert/load_nf4.py): while each linear is quantised, every
    linear not yet quantised still has no weight (meta); the result is bit for bit what loading
    in full precision then quantize_base gives (every NF4 buffer, its layout, every other
    tensor), and its logits are within compare.reference_bound of transformers on the round
    trip."""
    from megatron_lora.convert import load_nf4 as streaming
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf
    from megatron_lora.convert.logits import forward_logits
    from megatron_lora.models.build import build_model, model_config
    from megatron_lora.models.nf4_deferred import deferred_decoder_linears, deferred_linears
    from megatron_lora.models.nf4_linear import held_bytes, is_nf4
    from megatron_lora.models.nf4_model import quantize_base

    ref = load_file(nf4_mixtral["reference"])
    info, hf, _ = open_hf(nf4_mixtral["hf"])

    def build():
        return build_model(info, model_config(info, layout, dispatcher=dispatcher),
                           moe_grouped_gemm=grouped)

    whole = build()
    with pytest.raises(ValueError, match="must all be deferred"):  # local, before collectives
        streaming.load_nf4(whole, info, hf=hf)
    load_hf(whole, info, hf)
    quantize_base(whole)
    expected = {k: v for k, v in whole.state_dict(keep_vars=True).items()
                if isinstance(v, torch.Tensor)}
    expected.update(dict(whole.named_buffers()))
    layouts = {n: (m.nf4_layout, m.nf4_dtype) for n, m in whole.named_modules() if is_nf4(m)}
    original = streaming.quantize_linear_
    for source in (dict(hf=hf), dict(directory=nf4_mixtral_mcore)):
        with deferred_decoder_linears():
            model = build()
        linears = deferred_linears(model)
        assert [n for n, _ in linears] == list(layouts)
        largest = max(m.weight.numel() * m.weight.element_size() for _, m in linears)
        order = []

        def watched(name, linear, weight):
            still = [n for n, m in linears if not is_nf4(m) and n != name]
            assert all(m._parameters["weight"].is_meta for n, m in linears if n in still), name
            assert len(still) + len(order) + 1 == len(linears)
            # what the loader holds besides the NF4 linears made so far: this linear's shard
            # and reader caches (a stored chunk), never the linears to come (x tp: global sizes)
            extra = _live_bytes() - before - sum(held_bytes(m) for _, m in linears if is_nf4(m))
            assert 0 < extra <= 3 * layout.tp * largest, (name, extra, largest)
            order.append(name)
            original(name, linear, weight)

        streaming.quantize_linear_ = watched
        try:
            before = _live_bytes()
            assert streaming.load_nf4(model, info, **source) == len(layouts)
        finally:
            streaming.quantize_linear_ = original
        assert order == list(layouts)
        got = {k: v for k, v in model.state_dict(keep_vars=True).items()
               if isinstance(v, torch.Tensor)}
        got.update(dict(model.named_buffers()))
        assert got.keys() == expected.keys(), sorted(got.keys() ^ expected.keys())
        for k, v in expected.items():
            assert v.dtype == got[k].dtype and torch.equal(v, got[k]), (list(source), k)
        assert {n: (m.nf4_layout, m.nf4_dtype) for n, m in model.named_modules()
                if is_nf4(m)} == layouts
        logits = forward_logits(model, ref["tokens"], info.vocab_size)
        if parity.assert_held_by(logits, 1, "the logits"):
            S.assert_near_reference(logits, (ref["nf4"], ref["nf4.fp64"]),
                                    f"streamed NF4 at {layout.describe()} {list(source)}")
