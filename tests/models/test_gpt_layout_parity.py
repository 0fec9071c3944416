"""A tiny Mixtral-like GPTModel gives the single-rank loss and embedding gradient at every layout."""

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
def test_loss_and_embedding_grad_match_single_rank(layout, dispatcher, world_size, tiny_reference):
    reference = parity.load_reference(tiny_reference)
    loss, grad = parity.run_layout(tiny_reference, tiny_moe_shape(), layout, dispatcher=dispatcher)
    torch.testing.assert_close(loss.reshape(1), reference["loss"], rtol=1e-5, atol=0)
    # Held on every rank of the first pipeline stage, and checked there. fp32; each element sums
    # at most CHAIN terms along its backward chain (compare.gradient_bound, the probabilistic
    # bound: 2 x 6 x sqrt(CHAIN) x 2**-24 x 100 x max |gradient| = 2.4e-3 of the largest element):
    # a missing reduction or a wrong shard moves elements by their own size
    if parity.assert_held_by(grad, world_size // layout.pp, "the embedding gradient"):
        want = reference["embedding_grad"]
        compare.assert_within(grad, want, compare.gradient_bound(want, CHAIN),
                              f"embedding gradient at {layout.describe()}")


@multirank(world_size=2, timeout=240)
def test_the_comparison_catches_a_wrong_shard(tiny_reference, layout=ParallelLayout(tp=2, sp=True)):
    """One TP rank's qkv shard off by 1e-3: the loss must no longer match within rtol 1e-5."""
    shape = tiny_moe_shape()
    model = build_gpt_model(shape, transformer_config(shape, layout))
    load_weights(model, os.path.join(tiny_reference, "weights"))
    if parallel_state.get_tensor_model_parallel_rank() == 1:
        with torch.no_grad():
            model.decoder.layers[0].self_attention.linear_qkv.weight.add_(1e-3)
    loss, _ = parity.loss_and_embedding_grad(model, shape)
    reference = parity.load_reference(tiny_reference)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(loss.reshape(1), reference["loss"], rtol=1e-5, atol=0)
