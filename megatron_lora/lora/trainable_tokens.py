"""Trainable tokens: learned rows of the word embedding and the output layer for listed token ids
(new special tokens), PEFT's `trainable_token_indices`, exact under TP and SP.

Semantics (PEFT's TrainableTokensLayer): the rows of the listed ids are REPLACED by the trainable
values, everything else is the frozen base, so existing tokens' rows stay bit-identical:
    embedding:     E'[ids[j]] = delta_e[j]                      E' = E elsewhere
    output layer:  W'[ids[j]] = delta_o[j]  (logits = x W'^T)   W' = W elsewhere
The deltas are initialised to the rows' current values (PEFT's init), so an untrained adapter is
a no-op.

Global layout (n listed ids, h hidden, V padded vocabulary, t = the embedding's TP group size):
    trainable_tokens_delta [n, h], REPLICATED on every TP rank, row j for token ids[j].
The base weights stay vocabulary-sharded ([V/t, h] per rank); nothing is ever written to them.
New tokens take free padded rows; ids past them need a model built with a grown padded vocabulary
(`info_for_tokens`: the next multiple of 128, grown rows zero; a base from HF only).

Embedding forward on ids [b, s]: the base output ([b, s, h] replicated, or [s/t, b, h] under SP:
`reduce_scatter_embeddings`) gets, at the positions holding a listed id, delta_e's row instead
(torch.where; positions of this rank's sequence shard under SP). No collective: the ids are
replicated. Backward: without SP the output gradient is complete on every rank, so delta_e's is;
under SP each rank sees its own tokens: delta_e carries `sequence_parallel = True`, and megatron's
finalize_model_grads sums it over the TP group (as for embedding LoRA's B).

Output layer forward on x ([s, b, h] replicated, or [s/t, b, h] under SP): u = x delta_o^T
([.., n], the new tokens' logits, computed on every rank), then each rank writes the columns of the
ids in its vocabulary range into the base's logits shard [s, b, V/t] (index_copy: the base's value
there gets no gradient). Under SP u is all-gathered over tokens ([s/t, b, n] -> [s, b, n]); without
SP its gradient is all-reduced (only the owning rank's column has one): then the input gradient
and delta_o's gradient are complete on every rank; under SP delta_o's is partial over tokens and
carries `sequence_parallel = True` (summed by finalize_model_grads). Communication: one [T, n]
collective per forward+backward, like LoRA's [T, r]. With a gathered output ([s, b, V]) every
column is local and the gradient already complete.

Tied embeddings (one stage holding both): the output layer's adapter uses the embedding adapter's
delta (one parameter, as PEFT ties them), registered only on the embedding.

Checkpoint: `trainable_tokens_delta` is a replicated ShardedTensor beside the base's unchanged
entries (any TP/PP layout reloads it).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_lora.lora import collectives as C
from megatron_lora.lora.checkpoint import (
    accept_unwrapped_keys,
    factor_sharded_tensors,
    with_dp_cp_group,
)
from megatron_lora.lora.parallel import UnsupportedBaseLayerError

DELTA = "trainable_tokens_delta"
FLAG = "--add-special-tokens"


def check_token_ids(ids: Sequence[int], vocab_size: int, what: str = "vocabulary") -> tuple:
    """The ids as a tuple of ints, each in [0, vocab_size), distinct; ValueError otherwise."""
    ids = tuple(int(i) for i in ids)
    if not ids:
        raise ValueError("trainable_token_indices is empty")
    if len(set(ids)) != len(ids):
        raise ValueError(f"trainable_token_indices {list(ids)} has repeated ids")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(
            f"trainable token ids {bad} ({FLAG}) are outside the model's {what} of {vocab_size} "
            f"rows; build the model for them (a grown vocabulary: trainable_tokens."
            f"info_for_tokens, which train, logits and generate use with --load-hf)")
    return ids


def served_vocab(vocab_size: int, lora=None) -> int:
    """The vocabulary a model with adapter config `lora` serves: the model's vocab_size, grown
    to the trainable tokens' ids (they may lie in megatron's padded rows past vocab_size)."""
    ids = tuple(getattr(lora, "trainable_token_indices", None) or ())
    return max([vocab_size] + [i + 1 for i in ids])


def info_for_tokens(info, ids: Sequence[int], load: Optional[str] = None):
    """The ModelInfo a model training (or serving) the token ids is built from: `info` when
    the ids fit its padded vocabulary, else one whose padded vocabulary grows to the next
    multiple of 128 holding them (the base rows [0, vocab_size) as loaded, the rest zero).
    Growing needs a base read from HF (--load-hf: its mapping zero-fills the grown rows); a
    megatron checkpoint (`load`) has a fixed row count: ValueError naming the flags."""
    import dataclasses

    from megatron_lora.families import padded_vocab_size

    need = max((int(i) + 1 for i in ids), default=0)
    if need <= info.shape.vocab_size:
        return info
    if load:
        raise ValueError(
            f"{FLAG}: token id {need - 1} needs a vocabulary of {padded_vocab_size(need)} rows, "
            f"but --load {load} holds {info.shape.vocab_size} (vocab_size {info.vocab_size} padded); "
            f"growing the vocabulary needs the base from --load-hf")
    shape = dataclasses.replace(info.shape, vocab_size=padded_vocab_size(need))
    return dataclasses.replace(info, shape=shape)


def _rows_of(weight_shard, ids, start, end, group):
    """The global rows ids of a vocabulary-sharded weight ([V/t, h] per rank), [n, h] on every
    rank: each id's row comes from its owner, others add exact zeros (one [n, h] all-reduce)."""
    rows = torch.zeros(len(ids), weight_shard.shape[1], dtype=torch.float32,
                       device=weight_shard.device)
    for j, i in enumerate(ids):
        if start <= i < end:
            rows[j] = weight_shard[i - start].detach().float()
    if group.size() > 1:
        torch.distributed.all_reduce(rows, group=group)
    return rows


def _mark(delta, sequence_parallel: bool):
    delta.tensor_model_parallel, delta.partition_dim, delta.partition_stride = False, -1, 1
    delta.allreduce = True
    delta.sequence_parallel = sequence_parallel


class TrainableTokensEmbedding(torch.nn.Module):
    """Around a VocabParallelEmbedding; forward(ids [b, s]) returns what the base returns ([b, s, h]
    replicated, or [s/t, b, h] with reduce_scatter_embeddings) with the listed ids' rows replaced.
    `trainable_tokens_delta` [n, h] replicated; `token_ids` the n global ids."""

    def __init__(self, base_layer, token_ids: Sequence[int], *, dtype=None, freeze_base=True):
        super().__init__()
        self.base_layer = base_layer
        self.token_ids = check_token_ids(token_ids, base_layer.num_embeddings)
        group = base_layer.tp_group
        self._tp = (group, group.size(), group.rank())
        w = base_layer.weight
        rows = _rows_of(w, self.token_ids, base_layer.vocab_start_index,
                        base_layer.vocab_end_index, group)
        self.trainable_tokens_delta = torch.nn.Parameter(rows.to(dtype or w.dtype))
        self.sequence_parallel = bool(base_layer.reduce_scatter_embeddings) and group.size() > 1
        _mark(self.trainable_tokens_delta, self.sequence_parallel)
        self.register_buffer("_ids", torch.tensor(self.token_ids, dtype=torch.long,
                                                  device=w.device), persistent=False)
        if freeze_base:
            for p in base_layer.parameters(recurse=False):
                p.requires_grad_(False)
        accept_unwrapped_keys(self)

    @property
    def weight(self):  # LanguageModule reads `word_embeddings.weight` (tying, grad reduction)
        return self.base_layer.weight

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        output = self.base_layer(input_)
        group, t, k = self._tp
        ids = input_
        if self.base_layer.reduce_scatter_embeddings:
            ids = ids.t()  # [s, b], the layout of the output
            if t > 1:
                s_local = ids.shape[0] // t
                ids = ids[k * s_local:(k + 1) * s_local]
        # slot[..., ] = j where ids == token_ids[j], else -1
        match = ids.unsqueeze(-1) == self._ids.to(ids.device)  # [.., n]
        hit = match.any(-1, keepdim=True)
        slot = match.to(torch.long).argmax(-1)
        rows = torch.nn.functional.embedding(slot, self.trainable_tokens_delta.to(output.dtype))
        return torch.where(hit, rows, output)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The base's entries unchanged, trainable_tokens_delta replicated over the TP group."""
        metadata = with_dp_cp_group(metadata)
        state = self.base_layer.sharded_state_dict(prefix, sharded_offsets, metadata)
        state.update(factor_sharded_tensors({DELTA: self.trainable_tokens_delta}, prefix, {},
                                            sharded_offsets, metadata, self._tp[0]))
        return state


class TrainableTokensOutput(torch.nn.Module):
    """Around the output layer (column-parallel [V, h], weight owned or tied); forward(x, *args,
    **kwargs) -> (logits, bias) as the base returns them ([s, b, V/t], or [s, b, V] with
    gather_output), the listed ids' columns computed from `trainable_tokens_delta` [n, h]
    (replicated; with `tied` the embedding adapter's, not registered here)."""

    def __init__(self, base_layer, token_ids: Sequence[int], *, dtype=None, freeze_base=True,
                 tied: Optional[TrainableTokensEmbedding] = None):
        super().__init__()
        self.base_layer = base_layer
        vocab = base_layer.output_size
        self.token_ids = check_token_ids(token_ids, vocab)
        group = base_layer.tp_group if hasattr(base_layer, "tp_group") else None
        if group is None:
            from megatron.core import parallel_state
            group = parallel_state.get_tensor_model_parallel_group()
        t, k = group.size(), group.rank()
        self._tp = (group, t, k)
        local = vocab // t
        self._start = k * local
        self._local = local
        self.sequence_parallel = bool(getattr(base_layer, "sequence_parallel", False)) and t > 1
        self._tied = [tied] if tied is not None else []  # a list: not a submodule
        if tied is None:
            w = base_layer.weight
            rows = _rows_of(w, self.token_ids, self._start, self._start + local, group)
            self.trainable_tokens_delta = torch.nn.Parameter(rows.to(dtype or w.dtype))
            _mark(self.trainable_tokens_delta, self.sequence_parallel)
        if freeze_base:
            for p in base_layer.parameters(recurse=False):
                p.requires_grad_(False)
        accept_unwrapped_keys(self)

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return getattr(self.base_layer, "bias", None)

    def delta(self) -> torch.Tensor:
        """The [n, h] rows in use (the embedding's when tied)."""
        return self._tied[0].trainable_tokens_delta if self._tied else self.trainable_tokens_delta

    def forward(self, input_: torch.Tensor, *args, **kwargs):
        logits, bias = self.base_layer(input_, *args, **kwargs)
        group, t, _ = self._tp
        gathered = logits.shape[-1] != self._local or t == 1  # every column on this rank
        d = self.delta()
        u = torch.nn.functional.linear(input_, d.to(input_.dtype))  # [.., n]
        if self.sequence_parallel:
            u = C.gather_tokens(u, group, grad_is_partial=not gathered)
        elif not gathered:
            u = C.grad_all_reduce(u, group)
        if gathered:
            cols = list(range(len(self.token_ids)))
            where = list(self.token_ids)
        else:
            cols = [j for j, i in enumerate(self.token_ids)
                    if self._start <= i < self._start + self._local]
            where = [self.token_ids[j] - self._start for j in cols]
        # With no listed id on this rank the index is empty: u still joins the graph, so the
        # backward collective runs on every rank (with a zero gradient from here).
        index = torch.tensor(where, dtype=torch.long, device=logits.device)
        pick = torch.tensor(cols, dtype=torch.long, device=logits.device)
        out = logits.index_copy(-1, index, u.index_select(-1, pick).to(logits.dtype))
        return out, bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The base's entries unchanged, plus trainable_tokens_delta (replicated) when not tied."""
        metadata = with_dp_cp_group(metadata)
        state = self.base_layer.sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets,
                                                   metadata=metadata)
        if not self._tied:
            state.update(factor_sharded_tensors({DELTA: self.trainable_tokens_delta}, prefix, {},
                                                sharded_offsets, metadata, self._tp[0]))
        return state


def wrap_trainable_tokens(embedding, output_layer, token_ids, *, tied: bool, dtype=None):
    """(embedding adapter or None, output adapter or None) for this stage's modules (either may
    be None: pipeline stages). tied: the model shares the embedding and output weights; then
    both must be on this stage (one delta), else a clear error."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    if tied and (embedding is None) != (output_layer is None):
        raise UnsupportedBaseLayerError(
            f"{FLAG} with tied embeddings (share_embeddings_and_output_weights) needs the "
            f"embedding and the output layer on one pipeline stage; untie them or use PP=1")
    emb = out = None
    if embedding is not None:
        if not isinstance(embedding, VocabParallelEmbedding):
            raise UnsupportedBaseLayerError(
                f"{FLAG} needs a megatron-core VocabParallelEmbedding, got "
                f"{type(embedding).__name__} (LoRA on the embedding and trainable tokens cannot "
                f"be combined)")
        emb = TrainableTokensEmbedding(embedding, token_ids, dtype=dtype)
    if output_layer is not None:
        if getattr(output_layer, "base_layer", None) is not None:
            raise UnsupportedBaseLayerError(
                f"{FLAG}: LoRA on the output layer and trainable tokens cannot be combined; drop "
                f"output_layer from --lora-target-modules")
        out = TrainableTokensOutput(output_layer, token_ids, dtype=dtype,
                                    tied=emb if tied else None)
    return emb, out


def model_token_problems(model, ids) -> list:
    """Trainable-token problems of a GPT model that every rank finds alike (stages without an
    embedding too): ids outside the padded vocabulary, tied embeddings over pipeline stages."""
    from megatron.core import parallel_state

    if not ids:
        return []
    try:
        check_token_ids(ids, model.vocab_size, "padded vocabulary")
    except ValueError as exc:
        return [str(exc)]
    if (getattr(model, "share_embeddings_and_output_weights", False)
            and parallel_state.get_pipeline_model_parallel_world_size() > 1):
        return ["trainable tokens (--add-special-tokens) with tied embeddings need the embedding "
                "and the output layer on one pipeline stage: use PP=1 or untied embeddings"]
    return []


def wrap_model_tokens(model, ids, dtype=None) -> dict:
    """Trainable tokens on this stage's word embedding and output layer of a GPT model, in
    place; {"embedding.trainable_tokens" / "output_layer.trainable_tokens": wrapper} (keyed apart
    from LoRA adapters: these hold rows, not factors)."""
    embedding = getattr(model, "embedding", None)
    word = getattr(embedding, "word_embeddings", None)
    output = model.output_layer if getattr(model, "post_process", False) else None
    emb, out = wrap_trainable_tokens(
        word, output, ids, dtype=dtype,
        tied=bool(getattr(model, "share_embeddings_and_output_weights", False)))
    wrapped = {}
    if emb is not None:
        embedding.word_embeddings = wrapped["embedding.trainable_tokens"] = emb
    if out is not None:
        model.output_layer = wrapped["output_layer.trainable_tokens"] = out
    return wrapped


__all__ = ["DELTA", "TrainableTokensEmbedding", "TrainableTokensOutput", "check_token_ids",
           "info_for_tokens", "model_token_problems", "served_vocab", "wrap_model_tokens",
           "wrap_trainable_tokens"]
