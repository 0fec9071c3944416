"""Choosing the next token from a logits row: greedy, or temperature / top-k / top-p sampling.

The same rules as transformers' `generate` logits processors (TemperatureLogitsWarper,
TopKLogitsWarper, TopPLogitsWarper, applied in that order, then a multinomial draw), so that
users who know those flags get what they expect. Greedy (temperature 0) is argmax, first index on
ties, as torch.argmax and transformers do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingConfig:
    """max_new_tokens: tokens to add at most (generation also stops at the tokenizer's EOS);
    temperature: 0 = greedy, else logits / temperature; top_k: keep the k most likely (0 = all);
    top_p: keep the smallest set whose probability reaches top_p (1 = all); seed: the sampling
    generator's seed (one generator for a whole `generate` call, so prompts in order)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 1234

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no top-k filter), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sampling_scores(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """logits [vocab] -> the scores a token is drawn from (softmax of them): logits /
    temperature with -inf outside the top-k and outside the top-p set. Needs temperature > 0."""
    scores = logits.float() / config.temperature
    if config.top_k:
        kth = torch.topk(scores, min(config.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if config.top_p < 1.0:
        # Ascending order: drop the low tail whose total probability is <= 1 - top_p; the most
        # likely token always stays.
        sorted_scores, order = torch.sort(scores)
        tail = sorted_scores.softmax(-1).cumsum(-1) <= 1.0 - config.top_p
        tail[-1] = False
        scores = scores.masked_fill(tail.scatter(0, order, tail), float("-inf"))
    return scores


def next_token(logits: torch.Tensor, config: SamplingConfig,
               generator: torch.Generator) -> int:
    """logits: [vocab] (the full vocabulary, fp32, one position, on any device). Returns the
    chosen id (one host read). Draws come from `generator`, a host generator, so a seed gives
    the same draws on any device: the probabilities cross to the host to be drawn from."""
    if config.greedy:
        return int(torch.argmax(logits))
    probs = sampling_scores(logits, config).softmax(-1)
    return int(torch.multinomial(probs.to("cpu"), 1, generator=generator))
