"""Sampling rules equal transformers' logits warpers (temperature, top-k, top-p), and greedy is
argmax; SamplingConfig refuses bad values naming the field."""

import pytest
import torch

from megatron_lora.inference.sampling import SamplingConfig, next_token, sampling_scores
from megatron_lora.testing.compare import assert_within


def _transformers_scores(logits, temperature, top_k, top_p):
    from transformers import (LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)

    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0]


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.5, 20, 0.9), (2.0, 3, 0.05)])
def test_scores_match_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(250, generator=torch.Generator().manual_seed(3)) * 3
    ours = sampling_scores(logits, SamplingConfig(max_new_tokens=1, temperature=temperature,
                                                  top_k=top_k, top_p=top_p))
    theirs = _transformers_scores(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    kept = ~torch.isinf(ours)
    assert 0 < int(kept.sum()) <= (top_k or 250)
    # Exact: a kept score is one fp32 division of the same logit by the same temperature on both
    # sides (TemperatureLogitsWarper's `scores / temperature`), correctly rounded, so the same;
    # the masks only replace other elements with -inf
    assert_within(ours[kept], theirs[kept], 0.0, "kept scores")


def test_greedy_is_argmax_and_sampling_follows_the_seed():
    logits = torch.randn(250, generator=torch.Generator().manual_seed(4))
    greedy = SamplingConfig(max_new_tokens=1)
    assert next_token(logits, greedy, torch.Generator()) == int(logits.argmax())
    hot = SamplingConfig(max_new_tokens=1, temperature=5.0, top_k=50)
    draws = [[next_token(logits, hot, g) for _ in range(20)]
             for g in (torch.Generator().manual_seed(1), torch.Generator().manual_seed(1))]
    assert draws[0] == draws[1] and len(set(draws[0])) > 1
    top = set(torch.topk(logits, 50).indices.tolist())
    assert set(draws[0]) <= top


@pytest.mark.parametrize("field,value", [("max_new_tokens", 0), ("temperature", -1.0),
                                         ("top_k", -2), ("top_p", 0.0), ("top_p", 1.5)])
def test_bad_values_are_refused_naming_the_field(field, value):
    kwargs = dict(dict(max_new_tokens=4), **{field: value})
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**kwargs)
