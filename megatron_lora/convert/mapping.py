"""The one mapping between a family's Hugging Face tensors and megatron-core checkpoint tensors.

Every tool uses `mcore_tensors(info)`: hf-to-mcore writes each chunk from its source, `--load-hf`
reads the part of each chunk a rank owns, mcore-to-hf reads each chunk's box back and `split`s it
into HF tensors.

Megatron-side names are the keys of megatron-core's sharded state dict (torch_dist checkpoints):
per-layer tensors are stacked on a leading layer axis [L, ...], expert tensors on [L, E, ...].
A model with dense layers between its MoE layers (ModelShape.moe_layer_pattern) is keyed per
layer instead (`decoder.layers.{l}.` + the same name, no layer axis: convert/layer_keys.py);
its dense layers have `mlp.linear_fc1.weight` [2F, h] (rows [gate; up], F the dense FFN size)
and `mlp.linear_fc2.weight` [h, F] from `model.layers.l.mlp.{gate,up,down}_proj.weight`, and no
router or experts.

HF names come from the family (`info.family.names`, families/family.py HFNames); the table shows
Mixtral's.

| HF (layer l, expert e)                                | megatron key, chunk                   |
|-------------------------------------------------------|---------------------------------------|
| model.embed_tokens.weight [V, h]                      | embedding.word_embeddings.weight      |
|                                                       |   [Vp, h] rows 0..V (V..Vp are zeros) |
| model.layers.l.input_layernorm.weight [h]             | decoder.layers.self_attention.        |
|                                                       |   linear_qkv.layer_norm_weight [L, h] |
| model.layers.l.self_attn.{q,k,v}_proj.weight          | decoder.layers.self_attention.        |
|   q [n*d, h], k and v [g*d, h]                        |   linear_qkv.weight [L, (n+2g)*d, h]  |
|                                                       |   per query group j: [q heads of j; k_j; v_j] |
| ...self_attn.{q,k}_norm.weight (qk_layernorm only)    | ...self_attention.{q,k}_layernorm.    |
|   per head [d]; qk_norm_full_width: [n*d], [g*d]      |   weight [L, d] / [L, n*d], [L, g*d]  |
| model.layers.l.self_attn.o_proj.weight [h, n*d]       | ...self_attention.linear_proj.weight  |
| model.layers.l.post_attention_layernorm.weight [h]    | decoder.layers.mlp.linear_fc1.layer_norm_weight |
| model.layers.l.block_sparse_moe.gate.weight [E, h]    | decoder.layers.mlp.router.weight      |
| ...experts.e.w1.weight [f, h] (gate)                  | decoder.layers.mlp.experts.experts.   |
| ...experts.e.w3.weight [f, h] (up)                    |   linear_fc1.weight [L, E, 2f, h]:    |
|                                                       |   rows 0..f = w1, f..2f = w3          |
| ...experts.e.w2.weight [h, f]                         | ...experts.experts.linear_fc2.weight  |
| model.norm.weight [h]                                 | decoder.final_layernorm.weight        |
| lm_head.weight [V, h] (untied only)                   | output_layer.weight [Vp, h]           |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from megatron_lora.convert import mla_tensors
from megatron_lora.convert.layer_keys import layer_key, unstack
from megatron_lora.convert.sources import Direct
from megatron_lora.families import ModelInfo

Slices = Tuple[slice, ...]


class Zeros:
    """Padding rows (of the padded vocabulary): zeros on import, dropped on export."""

    def __init__(self, shape: Tuple[int, ...], dtype: torch.dtype):
        self.shape, self.dtype = tuple(shape), dtype

    def hf_shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {}

    def read(self, reader, index: Slices) -> torch.Tensor:
        return torch.zeros([s.stop - s.start for s in index], dtype=self.dtype, device="cpu")

    def split(self, data: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {}


class QKV:
    """megatron's fused QKV weight [(n+2g)*d, h] built from HF q [n*d, h], k, v [g*d, h].

    Rows are grouped by query group j (0..g-1): the n/g query heads of group j, then k head j,
    then v head j. Reading rows r0..r1 touches only the HF rows those rows come from.
    """

    def __init__(self, q: str, k: str, v: str, heads: int, groups: int, head_dim: int, hidden: int):
        self.names = (q, k, v)
        self.groups, self.d, self.hidden = groups, head_dim, hidden
        self.qpg = heads // groups
        self.block = (self.qpg + 2) * head_dim  # rows per query group
        self.shape = (groups * self.block, hidden)

    def hf_shapes(self) -> Dict[str, Tuple[int, ...]]:
        q, k, v = self.names
        kv = (self.groups * self.d, self.hidden)
        return {q: (self.groups * self.qpg * self.d, self.hidden), k: kv, v: kv}

    def _segments(self, r0: int, r1: int):
        """(hf name, first HF row, rows) runs covering fused rows r0..r1, in order."""
        parts = ((0, self.qpg * self.d), (self.qpg * self.d, self.d), ((self.qpg + 1) * self.d, self.d))
        for j in range(r0 // self.block, (r1 - 1) // self.block + 1):
            for name, (start, rows), width in zip(self.names, parts, (self.qpg * self.d, self.d, self.d)):
                lo = max(r0, j * self.block + start)
                hi = min(r1, j * self.block + start + rows)
                if lo < hi:
                    yield name, j * width + lo - j * self.block - start, hi - lo

    def read(self, reader, index: Slices) -> torch.Tensor:
        rows, cols = index
        pieces = [reader.read(name, (slice(a, a + n), cols)) for name, a, n in
                  self._segments(rows.start, rows.stop)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)

    def split(self, data: torch.Tensor) -> Dict[str, torch.Tensor]:
        blocks = data.reshape(self.groups, self.block, self.hidden)
        q_rows = self.qpg * self.d
        q, k, v = self.names
        return {
            q: blocks[:, :q_rows].reshape(-1, self.hidden).contiguous(),
            k: blocks[:, q_rows:q_rows + self.d].reshape(-1, self.hidden).contiguous(),
            v: blocks[:, q_rows + self.d:].reshape(-1, self.hidden).contiguous(),
        }


class QKVBias(QKV):
    """megatron's fused QKV bias [(n+2g)*d] from HF q [n*d], k, v [g*d] biases, rows grouped by
    query group as the weight's are (QKV)."""

    def __init__(self, q: str, k: str, v: str, heads: int, groups: int, head_dim: int):
        super().__init__(q, k, v, heads, groups, head_dim, hidden=1)
        self.shape = (groups * self.block,)

    def hf_shapes(self) -> Dict[str, Tuple[int, ...]]:
        return {name: shape[:1] for name, shape in super().hf_shapes().items()}

    def read(self, reader, index: Slices) -> torch.Tensor:
        rows, = index
        pieces = [reader.read(name, (slice(a, a + n),)) for name, a, n in
                  self._segments(rows.start, rows.stop)]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)

    def split(self, data: torch.Tensor) -> Dict[str, torch.Tensor]:
        parts = super().split(data.reshape(-1, 1))
        return {name: t.reshape(-1) for name, t in parts.items()}


@dataclass(frozen=True)
class Chunk:
    """A box of a megatron tensor: offsets/sizes over the full (stacked) shape; sizes are
    (1,)*k + source.shape, the leading 1s being the layer (and expert) axes."""

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    source: object


@dataclass(frozen=True)
class McoreTensor:
    """dtype: stored in this dtype rather than the checkpoint's (set by conversion for tensors
    whose HF dtype is their own, OWN_DTYPE_SUFFIXES); None: the checkpoint's."""

    key: str
    shape: Tuple[int, ...]
    chunks: Tuple[Chunk, ...]
    dtype: Optional[torch.dtype] = None


@dataclass(frozen=True)
class ExtraState:
    """A megatron ShardedObject (a linear's `_extra_state`; None for local and non-fp8 layers)."""

    unique_key: str


def _vocab_tensor(key: str, hf_name: str, info: ModelInfo, dtype) -> McoreTensor:
    v, vp, h = info.vocab_size, info.shape.vocab_size, info.shape.hidden_size
    chunks = [Chunk((0, 0), (v, h), Direct(hf_name, (v, h)))]
    if vp > v:
        chunks.append(Chunk((v, 0), (vp - v, h), Zeros((vp - v, h), dtype)))
    return McoreTensor(key, (vp, h), tuple(chunks))


def mcore_tensors(info: ModelInfo, dtype: torch.dtype = None,
                  stacked: bool = False) -> List[McoreTensor]:
    """Every megatron tensor of the model with the chunks that make it, in HF order, keyed as
    megatron-core keys them (per layer for a model with dense layers).

    dtype: the dtype of zero padding rows (the checkpoint's dtype; default info.dtype).
    stacked: layer tensors always stacked on a leading layer axis, as a homogeneous model's are
    (the adapter table's view; a dense layer has no chunk in the experts' tensors and an MoE
    layer none in the dense MLP's).
    """
    s = info.shape
    dtype = dtype or info.dtype
    L, E, h, f, d = s.num_layers, s.num_experts, s.hidden_size, s.ffn_hidden_size, info.head_dim
    n, g = s.num_attention_heads, s.num_query_groups
    fs, fd = s.shared_expert_ffn_hidden_size, s.dense_ffn_hidden_size
    qn, kn = s.qk_norm_widths()  # [d] per head, or [n*d] / [g*d] over the whole width
    out = [_vocab_tensor("embedding.word_embeddings.weight", info.family.names.embedding, info, dtype)]
    per_layer: Dict[str, List[Chunk]] = {}

    def layer(key: str, l: int, source) -> None:
        per_layer.setdefault(key, []).append(Chunk((l,) + (0,) * len(source.shape), (1,) + source.shape, source))

    def rows(key: str, l: int, row: int, source) -> None:
        offsets = (l, row) + (0,) * (len(source.shape) - 1)
        per_layer.setdefault(key, []).append(Chunk(offsets, (1,) + source.shape, source))

    def expert(key: str, l: int, e: int, row: int, source) -> None:
        offsets = (l, e, row) + (0,) * (len(source.shape) - 1)
        per_layer.setdefault(key, []).append(Chunk(offsets, (1, 1) + source.shape, source))

    attn, mlp = "decoder.layers.self_attention.", "decoder.layers.mlp."
    names = info.family.names
    for l in range(L):
        p = names.layer.format(l=l)
        if s.mla is not None:  # multi-latent attention: convert/mla_tensors.py
            for key, source in mla_tensors.attention_tensors(info, p):
                layer(key, l, source)
        else:
            layer(attn + "linear_qkv.layer_norm_weight", l, Direct(p + names.input_norm, (h,)))
            layer(attn + "linear_qkv.weight", l, QKV(p + names.q, p + names.k, p + names.v, n, g, d, h))
            if s.add_qkv_bias or s.add_bias_linear:
                bias = [p + w[: -len("weight")] + "bias" for w in (names.q, names.k, names.v)]
                layer(attn + "linear_qkv.bias", l, QKVBias(*bias, n, g, d))
            if s.qk_layernorm:
                layer(attn + "q_layernorm.weight", l, Direct(p + names.q_norm, (qn,)))
                layer(attn + "k_layernorm.weight", l, Direct(p + names.k_norm, (kn,)))
            layer(attn + "linear_proj.weight", l, Direct(p + names.o, (h, n * d)))
        layer(mlp + "linear_fc1.layer_norm_weight", l, Direct(p + names.post_attention_norm, (h,)))
        if not s.is_moe_layer(l):
            x = p + names.dense_mlp
            rows(mlp + "linear_fc1.weight", l, 0, Direct(x + names.expert_gate, (fd, h)))
            rows(mlp + "linear_fc1.weight", l, fd, Direct(x + names.expert_up, (fd, h)))
            layer(mlp + "linear_fc2.weight", l, Direct(x + names.expert_down, (h, fd)))
            continue
        layer(mlp + "router.weight", l, Direct(p + names.router, (E, h)))
        if s.moe_router_expert_bias:
            layer(mlp + "router.expert_bias", l, Direct(p + names.expert_bias, (E,)))
        if s.add_bias_linear or s.attention_sinks or info.family.fused_experts:
            for key, source in _gpt_oss_layer(info, p, dtype):
                layer(key, l, source)
        for e in range(0 if info.family.fused_experts else E):
            x = p + names.expert.format(e=e)
            expert(mlp + "experts.experts.linear_fc1.weight", l, e, 0, Direct(x + names.expert_gate, (f, h)))
            expert(mlp + "experts.experts.linear_fc1.weight", l, e, f, Direct(x + names.expert_up, (f, h)))
            expert(mlp + "experts.experts.linear_fc2.weight", l, e, 0, Direct(x + names.expert_down, (h, f)))
        if fs:
            x = p + names.shared_expert
            rows(mlp + "shared_experts.linear_fc1.weight", l, 0, Direct(x + names.expert_gate, (fs, h)))
            rows(mlp + "shared_experts.linear_fc1.weight", l, fs, Direct(x + names.expert_up, (fs, h)))
            layer(mlp + "shared_experts.linear_fc2.weight", l, Direct(x + names.expert_down, (h, fs)))
            if s.shared_expert_gate:
                layer(mlp + "shared_experts.gate_weight", l, Direct(p + names.shared_expert_gate, (1, h)))
    shapes = {
        attn + "linear_qkv.layer_norm_weight": (L, h),
        attn + "linear_qkv.weight": (L, (n + 2 * g) * d, h),
        attn + "linear_qkv.bias": (L, (n + 2 * g) * d),
        attn + "q_layernorm.weight": (L, qn),
        attn + "k_layernorm.weight": (L, kn),
        attn + "linear_proj.weight": (L, h, n * d),
        mlp + "linear_fc1.layer_norm_weight": (L, h),
        mlp + "router.weight": (L, E, h),
        mlp + "router.expert_bias": (L, E),
        mlp + "experts.experts.linear_fc1.weight": (L, E, 2 * f, h),
        mlp + "experts.experts.linear_fc2.weight": (L, E, h, f),
    }
    shapes.update({key: (L,) + source.shape for key, source in _gpt_oss_layer(info, "", dtype)})
    if s.mla is not None:
        shapes.update({key: (L,) + source.shape
                       for key, source in mla_tensors.attention_tensors(info, "")})
    if fs:
        shapes.update({mlp + "shared_experts.linear_fc1.weight": (L, 2 * fs, h),
                       mlp + "shared_experts.linear_fc2.weight": (L, h, fs),
                       mlp + "shared_experts.gate_weight": (L, 1, h)})
    if fd:
        shapes.update({mlp + "linear_fc1.weight": (L, 2 * fd, h),
                       mlp + "linear_fc2.weight": (L, h, fd)})
    out += [McoreTensor(k, shapes[k], tuple(c)) for k, c in per_layer.items()]
    out.append(McoreTensor("decoder.final_layernorm.weight", (h,), (Chunk((0,), (h,), Direct(info.family.names.final_norm, (h,))),)))
    if not s.tie_embeddings:
        out.append(_vocab_tensor("output_layer.weight", info.family.names.output, info, dtype))
    return unstack(out) if s.per_layer_keys and not stacked else out


def _gpt_oss_layer(info: ModelInfo, p: str, dtype) -> List[Tuple[str, object]]:
    """(megatron key, source) of one layer's tensors beyond the Llama-style ones: the output
    projection's and the router's biases (add_bias_linear), the attention sinks, and the fused
    experts with their biases (Family.fused_experts; convert/fused_experts.py). p: the layer's
    HF prefix."""
    from megatron_lora.convert.fused_experts import FusedExperts

    s, names = info.shape, info.family.names
    E, h, f, n = s.num_experts, s.hidden_size, s.ffn_hidden_size, s.num_attention_heads
    attn, mlp = "decoder.layers.self_attention.", "decoder.layers.mlp."
    out = []
    if s.add_bias_linear:
        out.append((attn + "linear_proj.bias", Direct(p + names.o[: -len("weight")] + "bias", (h,))))
        out.append((mlp + "router.bias", Direct(p + names.router[: -len("weight")] + "bias", (E,))))
    if s.attention_sinks:
        out.append((attn + "core_attention.softmax_offset", Direct(p + "self_attn.sinks", (n,))))
    if info.family.fused_experts:
        x, ex = p + names.expert, mlp + "experts.experts."
        out.append((ex + "linear_fc1.weight",
                    FusedExperts(x + "gate_up_proj", (E, h, 2 * f), True, True, dtype)))
        out.append((ex + "linear_fc2.weight",
                    FusedExperts(x + "down_proj", (E, f, h), True, False, dtype)))
        if s.add_bias_linear:
            out.append((ex + "linear_fc1.bias",
                        FusedExperts(x + "gate_up_proj_bias", (E, 2 * f), False, True)))
            out.append((ex + "linear_fc2.bias",
                        FusedExperts(x + "down_proj_bias", (E, h), False, False)))
    return out


def extra_states(info: ModelInfo) -> List[ExtraState]:
    """The ShardedObjects megatron-core's sharded state dict has for this model (all None):
    `/shard_{l}_{L}` (with the expert: `{l}.{e}_{L}.{E}`) stacked, `/shard_0_1` (`{e}_{E}`) keyed
    per layer."""
    s = info.shape
    L, E = s.num_layers, s.num_experts
    out = []

    def add(name: str, l: int, e: int = None) -> None:
        if s.per_layer_keys:
            shard = "0_1" if e is None else f"{e}_{E}"
            out.append(ExtraState(f"{layer_key('decoder.layers.' + name, l)}._extra_state/"
                                  f"shard_{shard}"))
        else:
            shard = f"{l}_{L}" if e is None else f"{l}.{e}_{L}.{E}"
            out.append(ExtraState(f"decoder.layers.{name}._extra_state/shard_{shard}"))

    attention = (mla_tensors.linear_names(info) if s.mla is not None
                 else ("linear_proj", "linear_qkv"))
    for l in range(L):
        for name in attention:
            add(f"self_attention.{name}", l)
        if not s.is_moe_layer(l):
            for name in ("linear_fc1", "linear_fc2"):
                add(f"mlp.{name}", l)
            continue
        for e in range(E):
            for name in ("linear_fc1", "linear_fc2"):
                add(f"mlp.experts.experts.{name}", l, e)
        if s.shared_expert_ffn_hidden_size:
            for name in ("linear_fc1", "linear_fc2"):
                add(f"mlp.shared_experts.{name}", l)
    return out


def hf_shapes(info: ModelInfo) -> Dict[str, Tuple[int, ...]]:
    """Every HF tensor name the model has, with the shape config.json implies."""
    out: Dict[str, Tuple[int, ...]] = {}
    for t in mcore_tensors(info):
        for c in t.chunks:
            out.update(c.source.hf_shapes())
    return out


# HF tensors kept in their own dtype whatever the weights' (GLM-4.5's fp32 score-correction bias
# beside bf16 weights; megatron holds it as an fp32 buffer).
OWN_DTYPE_SUFFIXES = ("mlp.gate.e_score_correction_bias",)

# HF tensors that carry no weights and may be present in older checkpoints.
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
