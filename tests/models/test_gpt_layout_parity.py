"""A tiny Mixtral-like GPTModel gives the single-rank loss and embedding gradient at every layout."""

import json
import math
import os

import pytest
import torch
from megatron.core import parallel_state

from megatron_lora.models.gpt import build_gpt_model, tiny_moe_shape, transformer_config
from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing import compare, parity
from megatron_lora.testing.reference import load_weights
from tests.harness import multirank

# The terms an embedding-gradient element accumulates along its longest backward chain: the 4 x 32
# tokens of the batch (parity.ParityBatch), the vocabulary's softmax, and per layer the hidden
# columns, the FFN and 32 keys
_S = tiny_moe_shape()
CHAIN = 4 * 32 + _S.vocab_size + _S.num_layers * (_S.hidden_size + _S.ffn_hidden_size + 32)



@multirank(world_size=1, timeout=240)
def _loss_rounding(directory, out, layout=ParallelLayout()):
    """The single-rank model on the parity batch in fp32 and again in fp64 (model.double(), the
    same weights and tokens): its per-token losses [B S] both ways, and its fp32 mean loss, to
    `out` (json)."""
    shape = tiny_moe_shape()
    model = build_gpt_model(shape, transformer_config(shape, layout))
    load_weights(model, os.path.join(directory, "weights"))
    tokens, labels = parity.make_batch(shape, parity.ParityBatch())
    position_ids = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    per_token = {}
    for dtype in (torch.float32, torch.float64):
        model.to(dtype)
        with torch.no_grad():
            logits = model(tokens, position_ids, attention_mask=None)  # [B, S, V]
        assert logits.dtype == dtype
        per_token[dtype] = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), reduction="none")
    with open(out, "w") as f:
        json.dump({"per_token_bound": compare.reference_bound(per_token[torch.float32],
                                                               per_token[torch.float64]),
                   "loss32": float(per_token[torch.float32].mean()),
                   "tokens": per_token[torch.float32].numel()}, f)


@pytest.fixture(scope="module")
def loss_bound(tiny_reference, tmp_path_factory):
    """How far the loss at any layout may lie from the single-rank one (fp32). Each token's loss
    is a log-softmax of the logits: compare.reference_bound of the per-token losses (the
    single-rank model's own fp32 rounding of them, measured against its fp64 evaluation) bounds
    each token's at another layout, another fp32 order of the same computation; their mean is
    then within that bound, plus the mean's own rounding over B S tokens in two orders
    (probabilistic, as compare.gradient_bound: 2 x 6 sqrt(B S) u x the loss, all terms
    positive). The loss of the single-rank reference run must lie within it too."""
    out = str(tmp_path_factory.mktemp("loss_rounding") / "bound.json")
    _loss_rounding(directory=tiny_reference, out=out)
    with open(out) as f:
        r = json.load(f)
    u = compare.unit_roundoff(torch.float32)
    bound = r["per_token_bound"] + 2 * 6 * math.sqrt(r["tokens"]) * u * r["loss32"]
    reference = float(parity.load_reference(tiny_reference)["loss"])
    assert abs(reference - r["loss32"]) <= bound, (reference, r["loss32"], bound)
    return bound


CASES = [
    pytest.param(ParallelLayout(tp=2, sp=True), "allgather", 2, id="TP2+SP"),
    pytest.param(ParallelLayout(ep=2), "allgather", 2, id="EP2-allgather"),
    pytest.param(ParallelLayout(ep=2), "alltoall", 2, id="EP2-alltoall"),
    pytest.param(ParallelLayout(pp=2), "allgather", 2, id="PP2"),
    pytest.param(ParallelLayout(), "allgather", 4, id="DP4"),
    pytest.param(ParallelLayout(tp=2, ep=2, sp=True), "allgather", 4, id="TP2xEP2+SP-allgather"),
    pytest.param(ParallelLayout(tp=2, ep=2, sp=True), "alltoall", 4, id="TP2xEP2+SP-alltoall"),
    pytest.param(ParallelLayout(pp=2, ep=2), "alltoall", 4, id="PP2xEP2"),
    pytest.param(ParallelLayout(tp=2, pp=2, ep=2, sp=True), "allgather", 8, id="TP2xPP2xEP2+SP"),
]


@pytest.mark.parametrize("layout,dispatcher,world_size", CASES)
@multirank(world_size=lambda world_size, **_: world_size, timeout=240)
def test_loss_and_embedding_grad_match_single_rank(layout, dispatcher, world_size, tiny_reference,
                                                   loss_bound):
    reference = parity.load_reference(tiny_reference)
    loss, grad = parity.run_layout(tiny_reference, tiny_moe_shape(), layout, dispatcher=dispatcher)
    # loss_bound: the reference's per-token rounding (reference_bound) and the mean's
    compare.assert_within(loss.reshape(1), reference["loss"], loss_bound,
                          f"loss at {layout.describe()}")
    # Held on every rank of the first pipeline stage, and checked there. fp32; each element sums
    # at most CHAIN terms along its backward chain (compare.gradient_bound, the probabilistic
    # bound: 2 x 6 x sqrt(CHAIN) x 2**-24 x 100 x max |gradient| = 2.4e-3 of the largest element):
    # a missing reduction or a wrong shard moves elements by their own size
    if parity.assert_held_by(grad, world_size // layout.pp, "the embedding gradient"):
        want = reference["embedding_grad"]
        compare.assert_within(grad, want, compare.gradient_bound(want, CHAIN),
                              f"embedding gradient at {layout.describe()}")


@multirank(world_size=2, timeout=240)
def test_the_comparison_catches_a_wrong_shard(tiny_reference, loss_bound,
                                             layout=ParallelLayout(tp=2, sp=True)):
    """One TP rank's qkv shard off by 1e-3: the loss must no longer match within loss_bound."""
    shape = tiny_moe_shape()
    model = build_gpt_model(shape, transformer_config(shape, layout))
    load_weights(model, os.path.join(tiny_reference, "weights"))
    if parallel_state.get_tensor_model_parallel_rank() == 1:
        with torch.no_grad():
            model.decoder.layers[0].self_attention.linear_qkv.weight.add_(1e-3)
    loss, _ = parity.loss_and_embedding_grad(model, shape)
    reference = parity.load_reference(tiny_reference)
    with pytest.raises(AssertionError, match="loss with a wrong shard"):
        compare.assert_within(loss.reshape(1), reference["loss"], loss_bound,
                              "loss with a wrong shard")
