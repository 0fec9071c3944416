"""LoRA on megatron's VocabParallelEmbedding (word embeddings), and on the output layer.

Embedding: out = E[ids] + scale * A^T[ids] B^T, PEFT's embedding LoRA.
Global layout (V vocabulary, h hidden, t = the embedding's TP group size):
    lora_A [r, V], sharded on dim 1 along the vocabulary exactly like the base's rows: rank k
        holds columns [k V/t, (k+1) V/t) (megatron's vocab range), i.e. local [r, V/t];
    lora_B [h, r], replicated.
Update: E += scale * (B A)^T ([V, h], local rows = local A columns: merge is local and exact).

Forward on ids [b, s]: like the base, each rank looks up the ids in its vocabulary range (masked
lookup, rows of other ranks give 0), giving a partial [b, s, r]; one [T, r] reduction completes
it: an all-reduce (output [b, s, h], replicated), or under SP (`reduce_scatter_embeddings`) a
transpose to [s, b, r] and a reduce-scatter to this rank's [s/t, b, r] (output [s/t, b, h]).
Then the up-projection B is added into the base output. Backward: the all-reduce's gradient is
the identity, the reduce-scatter's an all-gather of [s/t, b, r]; A's local columns get complete
gradients. B's gradient is complete without SP and a per-rank partial (own tokens) under SP: B
carries `sequence_parallel = True` there, so finalize_model_grads sums it over the TP group (the
embedding's group is the dense TP group). No dropout (the input is token ids).

Output layer: the column-parallel vocabulary projection is a `LoraAdapter` (A [r, h] replicated,
B [V, r] sharded on dim 0, [V/t, r] per rank); with tied embeddings its base allocates no weight
and is handed the embedding weight at forward, which the adapter passes through (merge is then
refused: it would change the embedding too). The embedding's and the output layer's adapters are
separate pairs whether the base weights are tied or not.
"""

from __future__ import annotations


import torch

from megatron_lora.lora import collectives as C
from megatron_lora.lora.adapter import LoraAdapter
from megatron_lora.lora.factors import init_global_factors, up_projection
from megatron_lora.lora.checkpoint import (
    accept_unwrapped_keys,
    factor_sharded_tensors,
    with_dp_cp_group,
)
from megatron_lora.lora.config import AdapterConfig
from megatron_lora.lora.merge import WeightDeltaMerge
from megatron_lora.lora.parallel import UnsupportedBaseLayerError


class EmbeddingLora(WeightDeltaMerge, torch.nn.Module):
    """LoRA around a VocabParallelEmbedding; forward(ids [b, s]) returns what the base returns
    ([b, s, h] replicated, or [s/t, b, h] with reduce_scatter_embeddings) plus the LoRA term.
    `lora_A` [r, V/t] (sharded dim 1), `lora_B` [h, r] (replicated)."""

    def __init__(self, base_layer, config: AdapterConfig, *, seed: int = 0, freeze_base=True):
        super().__init__()
        self.base_layer = base_layer
        self.config = config
        self.scaling = config.scaling
        self.merged = False
        self._disabled = False
        group = base_layer.tp_group
        t, k = group.size(), group.rank()
        vocab, hidden = base_layer.num_embeddings, base_layer.embedding_dim
        weight = base_layer.weight
        a, b = init_global_factors(config, vocab, hidden, seed)  # A [r, V], B [h, r]
        start, end = base_layer.vocab_start_index, base_layer.vocab_end_index
        dtype = config.dtype or weight.dtype
        self.lora_A = torch.nn.Parameter(a[:, start:end].to(weight.device, dtype).contiguous())
        self.lora_B = torch.nn.Parameter(b.to(weight.device, dtype).contiguous())
        self.sequence_parallel = bool(base_layer.reduce_scatter_embeddings) and t > 1
        self.lora_A.tensor_model_parallel, self.lora_A.partition_dim = True, 1
        self.lora_B.tensor_model_parallel, self.lora_B.partition_dim = False, -1
        for p in (self.lora_A, self.lora_B):
            p.partition_stride = 1
            p.allreduce = True
        self.lora_A.sequence_parallel = False
        self.lora_B.sequence_parallel = self.sequence_parallel
        self._tp = (group, t, k)
        if freeze_base:
            for p in base_layer.parameters(recurse=False):
                p.requires_grad_(False)
        accept_unwrapped_keys(self)

    @property
    def weight(self):  # LanguageModule reads `word_embeddings.weight` (tying, grad reduction)
        return self.base_layer.weight

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        output = self.base_layer(input_)
        if self.merged or self._disabled:
            return output
        return self._add_lora(input_, output)

    def _add_lora(self, ids, output):
        group, t, _ = self._tp
        base = self.base_layer
        a = self.lora_A.to(output.dtype)
        if t > 1:
            outside = (ids < base.vocab_start_index) | (ids >= base.vocab_end_index)
            local = (ids - base.vocab_start_index).masked_fill(outside, 0)
            u = torch.nn.functional.embedding(local, a.t())  # [b, s, r], partial over ranks
            u = u.masked_fill(outside.unsqueeze(-1), 0.0) * self.scaling
            if self.sequence_parallel:
                u = C.reduce_scatter_tokens(u.transpose(0, 1).contiguous(), group)
            else:
                u = C.all_reduce(u, group)
        else:
            u = torch.nn.functional.embedding(ids, a.t()) * self.scaling
            if base.reduce_scatter_embeddings:
                u = u.transpose(0, 1).contiguous()
        return up_projection(u, self.lora_B, output)

    def delta_weight(self) -> torch.Tensor:
        """This rank's rows of scale * (B A)^T: fp32 [V/t, h], the base weight's local shape."""
        return (self.lora_B.detach().float() @ self.lora_A.detach().float()).t() * self.scaling

    def _merge_target(self) -> torch.Tensor:
        return self.base_layer.weight

    def _check_mergeable(self) -> None:
        if getattr(self.base_layer.weight, "shared_embedding", False) or getattr(
            self.base_layer.weight, "zero_out_wgrad", False
        ):
            raise RuntimeError(
                "EmbeddingLora.merge: the word embedding is tied to the output layer; merging "
                "would change the output projection too"
            )

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The base's entries unchanged, lora_A sharded on dim 1 (vocab), lora_B replicated."""
        metadata = with_dp_cp_group(metadata)
        state = self.base_layer.sharded_state_dict(prefix, sharded_offsets, metadata)
        state.update(factor_sharded_tensors(
            {"lora_A": self.lora_A, "lora_B": self.lora_B}, prefix, {"lora_A": 1},
            sharded_offsets, metadata, self._tp[0],
        ))
        return state


def _check(config, rank_limit: int, what: str):
    if not isinstance(config, AdapterConfig):
        raise TypeError(f"config must be an AdapterConfig, got {type(config).__name__}")
    if config.rank > rank_limit:
        raise ValueError(
            f"AdapterConfig.rank={config.rank} is larger than min(in_features, out_features) = "
            f"{rank_limit} of the {what}"
        )


def wrap_embedding(embedding_module, config: AdapterConfig, *, seed: int, freeze_base=True):
    """Wrap a VocabParallelEmbedding; returns the EmbeddingLora, which the caller puts in the
    base's place (e.g. `model.embedding.word_embeddings = adapter`). Errors before anything."""
    from megatron.core.tensor_parallel.layers import VocabParallelEmbedding

    if not isinstance(embedding_module, VocabParallelEmbedding):
        raise UnsupportedBaseLayerError(
            "embedding LoRA needs a megatron-core VocabParallelEmbedding, got "
            f"{type(embedding_module).__name__}"
        )
    _check(config, min(embedding_module.num_embeddings, embedding_module.embedding_dim),
           "word embedding")
    return EmbeddingLora(embedding_module, config, seed=seed, freeze_base=freeze_base)


def wrap_output_layer(output_layer_module, config: AdapterConfig, *, seed: int, freeze_base=True):
    """Wrap the output layer (a column-parallel [V, h] projection, weight owned or tied); returns
    the LoraAdapter for the caller to put in its place (`model.output_layer = adapter`)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    if not isinstance(output_layer_module, ColumnParallelLinear) and getattr(
        output_layer_module, "parallel_mode", None
    ) != "column":
        raise UnsupportedBaseLayerError(
            "output-layer LoRA needs a column-parallel linear, got "
            f"{type(output_layer_module).__name__}"
        )
    return LoraAdapter(output_layer_module, config, seed=seed, freeze_base=freeze_base)


__all__ = ["EmbeddingLora", "wrap_embedding", "wrap_output_layer"]
