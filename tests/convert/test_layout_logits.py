"""The converted checkpoint and the direct HF load give transformers' eager logits at every
layout (fp32, within 11x transformers' own fp32 rounding on these tokens, measured against its
fp64 evaluation: compare.reference_bound), and the same logits as each other."""

import pytest
import torch
from safetensors.torch import load_file

from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing import parity
from tests.export import _support as S
from tests.harness import multirank

LAYOUTS = [
    pytest.param(ParallelLayout(), 1, id="TP1"),
    pytest.param(ParallelLayout(tp=2, sp=True), 2, id="TP2+SP"),
    pytest.param(ParallelLayout(ep=2), 2, id="EP2"),
    pytest.param(ParallelLayout(pp=2), 2, id="PP2"),
    pytest.param(ParallelLayout(tp=2, ep=2, sp=True), 4, id="TP2xEP2+SP"),
    pytest.param(ParallelLayout(pp=2, ep=2), 4, id="PP2xEP2"),
    pytest.param(ParallelLayout(tp=2, pp=2, ep=2, sp=True), 8, id="TP2xPP2xEP2+SP"),
]


def model_logits(info, layout, tokens, load):
    from megatron_lora.convert.logits import forward_logits
    from megatron_lora.models.build import build_model, model_config

    model = build_model(info, model_config(info, layout))
    load(model)
    return forward_logits(model, tokens, info.vocab_size)


@pytest.mark.parametrize("layout,world_size", LAYOUTS)
@multirank(world_size=lambda world_size, **_: world_size, timeout=300)
def test_logits_match_transformers(layout, world_size, tiny_mixtral):
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf, load_mcore

    ref = load_file(tiny_mixtral["reference"])
    info, hf, _ = open_hf(tiny_mixtral["hf"])
    from_mcore = model_logits(info, layout, ref["tokens"],
                              lambda m: load_mcore(m, tiny_mixtral["mcore"]))
    from_hf = model_logits(info, layout, ref["tokens"], lambda m: load_hf(m, info, hf))
    # The logits come back on exactly one rank (the writer), for both loads; checked there.
    held = parity.assert_held_by(from_mcore, 1, "the logits of the converted checkpoint")
    assert parity.assert_held_by(from_hf, 1, "the logits of the HF load") == held
    if not held:
        return
    assert from_mcore.shape == ref["logits"].shape == (4, 16, 250)
    assert from_mcore.dtype == torch.float32
    # the fp64 evaluation here, on the rank that holds the logits (the fixture's fp32 is kept)
    reference = ref["logits"], S.hf_logits(tiny_mixtral["hf"], ref["tokens"], torch.float64)
    S.assert_near_reference(from_mcore, reference, f"{layout.describe()} vs transformers")
    assert torch.equal(from_hf, from_mcore), (from_hf - from_mcore).abs().max()


@pytest.mark.parametrize("layout", [pytest.param(ParallelLayout(pp=2), id="PP2")])
@multirank(world_size=2, timeout=300)
def test_tied_embeddings_across_pipeline_stages(layout, tiny_tied):
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf

    ref = load_file(tiny_tied["reference"])
    info, hf, _ = open_hf(tiny_tied["hf"])
    assert info.shape.tie_embeddings and "lm_head.weight" not in hf.tensors
    logits = model_logits(info, layout, ref["tokens"], lambda m: load_hf(m, info, hf))
    if parity.assert_held_by(logits, 1, "the logits"):
        reference = ref["logits"], S.hf_logits(tiny_tied["hf"], ref["tokens"], torch.float64)
        S.assert_near_reference(logits, reference, f"tied at {layout.describe()} vs transformers")
