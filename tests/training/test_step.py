"""forward_backward on a real model: packed samples attend only within themselves, and masked
(prompt) tokens contribute nothing to the gradient."""

import torch

from megatron_lora.data import Sample, pack_samples
from megatron_lora.data.packing import inputs_labels_mask
from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing import compare
from megatron_lora.training.step import forward_backward
from tests.harness import multirank
from tests.training import _support as S


def _logits(model, tokens, attention_mask=None):
    positions = torch.arange(tokens.shape[1]).unsqueeze(0)
    with torch.no_grad():
        return model(tokens, positions, attention_mask=attention_mask)


@multirank(world_size=1)
def test_a_packed_sample_scores_exactly_as_it_would_alone(layout=ParallelLayout()):
    model = S.model(layout)
    a = Sample([256] + list(b"first sample"), [1] * 13)
    b = Sample([256] + list(b"the second one"), [1] * 15)
    rows = pack_samples([a, b], seq_length=S.SEQ, pad_id=258)
    tokens, _, _, mask = inputs_labels_mask(rows.tokens, rows.targets, rows.sample_ids)
    packed = _logits(model, tokens, mask)
    # The same model in fp64 scores each sample alone: its distance to the fp32 logits is the
    # fp32 rounding of this computation, and the packed scores (the same real computation in
    # another order: other matrix shapes, masked keys adding exact zeros, rotary angles at
    # other absolute positions) are within compare.reference_bound of them.
    model64 = S.model(layout)
    model64.load_state_dict(model.state_dict())
    model64.double()
    for sample, rows_of in ((b, slice(13, 28)), (a, slice(0, 13))):
        alone = _logits(model, torch.tensor([sample.tokens]))
        alone64 = _logits(model64, torch.tensor([sample.tokens]))
        compare.assert_within(packed[0, rows_of], alone[0],
                              compare.reference_bound(alone[0], alone64[0]),
                              f"packed logits of the sample at rows {rows_of}")
    alone_b = _logits(model, torch.tensor([b.tokens]))
    # Without the block mask, sample b would see sample a: the check can fail.
    leaky = _logits(model, tokens)
    assert (leaky[0, 13:28] - alone_b[0]).abs().max() > 1e-3


def _grads(model, tokens, labels, loss_mask):
    model.zero_grad(set_to_none=True)
    forward_backward([model], tokens, labels, loss_mask, micro_batch_size=1)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads, "no parameter received a gradient: the comparisons below would be vacuous"
    return grads


@multirank(world_size=1)
def test_prompt_tokens_contribute_nothing_to_the_gradient(layout=ParallelLayout()):
    model = S.model(layout)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, S.SEQ), generator=g)
    labels = torch.randint(0, 256, (2, S.SEQ), generator=g)
    loss_mask = torch.ones(2, S.SEQ)
    loss_mask[:, :12] = 0  # the prompt
    base = _grads(model, tokens, labels, loss_mask)
    other_prompt = labels.clone()
    other_prompt[:, :12] = torch.randint(0, 256, (2, 12), generator=g)
    # Exact: a masked token's loss enters as mask 0 x its finite cross-entropy, so the gradient
    # reaching its logits is exactly 0 whatever its label, and every other number of the backward
    # is the same computation on the same values.
    for name, grad in _grads(model, tokens, other_prompt, loss_mask).items():
        compare.assert_within(grad, base[name], 0.0, f"gradient of {name}")
    other_response = labels.clone()
    other_response[:, 20:] = (labels[:, 20:] + 1) % 256
    changed = _grads(model, tokens, other_response, loss_mask)
    assert any(not torch.equal(changed[n], base[n]) for n in base)
