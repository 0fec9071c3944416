"""Packing short samples into full sequences whose attention never crosses a sample boundary.

A packed row holds S+1 tokens: inputs are tokens[:-1], labels tokens[1:]. Samples are never split;
a sample that does not fit in a row's remaining space starts the next row and the rest of the row
is padding. Each position records which sample it belongs to, from which the attention mask is
built: position i may attend to j only if j <= i and both belong to the same sample. RoPE scores
depend only on the distance i - j, so a sample packed at an offset scores exactly as it would alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

from megatron_lora.data.jsonl import Sample


@dataclass
class PackedRows:
    tokens: torch.Tensor  # [N, S+1] int64
    targets: torch.Tensor  # [N, S+1] float: 1 where a token is a prediction target
    sample_ids: torch.Tensor  # [N, S+1] int64: index of the sample, -1 on padding
    num_samples: int


def pack_samples(samples: Sequence[Sample], seq_length: int, pad_id: int) -> PackedRows:
    """Greedy in-order packing into rows of seq_length+1 tokens (samples must fit in a row)."""
    width = seq_length + 1
    rows_tok: List[List[int]] = []
    rows_tgt: List[List[int]] = []
    rows_sid: List[List[int]] = []
    cur_tok, cur_tgt, cur_sid = [], [], []

    def flush():
        pad = width - len(cur_tok)
        rows_tok.append(cur_tok + [pad_id] * pad)
        rows_tgt.append(cur_tgt + [0] * pad)
        rows_sid.append(cur_sid + [-1] * pad)

    for index, sample in enumerate(samples):
        n = len(sample.tokens)
        if n > width:
            raise ValueError(f"sample {index} has {n} tokens, more than seq_length+1={width}")
        if len(cur_tok) + n > width:
            flush()
            cur_tok, cur_tgt, cur_sid = [], [], []
        cur_tok += sample.tokens
        cur_tgt += sample.loss_mask
        cur_sid += [index] * n
    if cur_tok:
        flush()
    return PackedRows(
        tokens=torch.tensor(rows_tok, dtype=torch.long, device="cpu"),
        targets=torch.tensor(rows_tgt, dtype=torch.float32, device="cpu"),
        sample_ids=torch.tensor(rows_sid, dtype=torch.long, device="cpu"),
        num_samples=len(samples),
    )


def inputs_labels_mask(tokens, targets, sample_ids):
    """From packed rows [B, S+1]: inputs, labels, loss_mask [B, S] and attention_mask [B, 1, S, S].

    loss_mask[j] is 1 when token j+1 is a target of the same sample as token j (the last token of a
    sample never learns to predict the first token of the next). attention_mask follows megatron's
    convention: True means "masked out".
    """
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    same = (sample_ids[:, :-1] == sample_ids[:, 1:]) & (sample_ids[:, :-1] >= 0)
    loss_mask = targets[:, 1:] * same.to(targets.dtype)
    sid = sample_ids[:, :-1]
    s = sid.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device="cpu").tril()
    allowed = (sid.unsqueeze(2) == sid.unsqueeze(1)) & causal
    # Padding rows attend to themselves only, so softmax never sees an all-masked row.
    allowed |= torch.eye(s, dtype=torch.bool, device="cpu")
    return inputs.contiguous(), labels.contiguous(), loss_mask.contiguous(), (~allowed).unsqueeze(1)
