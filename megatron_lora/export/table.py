"""Where every LoRA factor of an adapter checkpoint lives, on both sides (any family).

Derived from the one conversion table (`convert.mapping.mcore_tensors`): an adapter on a megatron
weight has B with that weight's rows ([out, r]) and A with its columns ([r, in]), so the chunks of
the base weight say which HF module each run of B's rows belongs to. Nothing here repeats the
q/k/v interleave or the [w1; w3] order: the mapping's own `QKV` and row offsets are used.

Megatron side (adapter checkpoints: ShardedTensor keys of the model's sharded state dict, layers
and experts as leading axes, global expert index; `lead` = number of leading axes):

| kind         | A key / global shape                     | B key / global shape        |
|--------------|------------------------------------------|-----------------------------|
| linear_qkv   | decoder.layers.self_attention.linear_qkv.lora_A [L, r, h]    | ...lora_B [L, (n+2g)d, r] |
| linear_proj  | decoder.layers.self_attention.linear_proj.lora_A [L, r, n d] | ...lora_B [L, h, r]       |
| linear_fc1   | decoder.layers.mlp.experts.experts.linear_fc1.lora_A [L, E, r, h] | ...lora_B [L, E, 2f, r] ([w1; w3] rows) |
| linear_fc2   | decoder.layers.mlp.experts.experts.linear_fc2.lora_A [L, E, r, f] | ...lora_B [L, E, h, r] |
| router       | decoder.layers.mlp.router.lora.lora_A [L, r, h]      | ...lora_B [L, E, r]             |
| embedding    | embedding.word_embeddings.lora_A [r, Vp]  | ...lora_B [h, r]           |
| output_layer | output_layer.lora_A [r, h]                | output_layer.lora_B [Vp, r] |
| shared_fc1   | decoder.layers.mlp.shared_experts.linear_fc1.lora_A [L, r, h] | ...lora_B [L, 2fs, r] |
| shared_fc2   | decoder.layers.mlp.shared_experts.linear_fc2.lora_A [L, r, fs] | ...lora_B [L, h, r] |
| dense_fc1    | decoder.layers.mlp.linear_fc1.lora_A [L, r, h] | ...lora_B [L, 2F, r] ([gate; up] rows) |
| dense_fc2    | decoder.layers.mlp.linear_fc2.lora_A [L, r, F] | ...lora_B [L, h, r] |

The shared experts' adapters (families with a shared expert) and the MLP adapters of dense layers
between MoE layers are LoRA target kinds linear_fc1 / linear_fc2 like the routed experts'
(`Kind.target`), checkpointed as their own tensors. The table is written stacked over layers; a
model with dense layers is checkpointed per layer (`decoder.layers.{l}.mlp.linear_fc1.lora_A`
[r, h], ...: convert/layer_keys.py), where a kind has sites on its own layers only (the dense
MLP's on dense layers, the router's and experts' on MoE layers).

HF PEFT side (per-expert layout; module names from the family, Mixtral's shown; keys `base_model.model.{module}.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]; the embedding `base_model.model.model.embed_tokens.lora_embedding_A`
[r, V] and `...lora_embedding_B` [h, r], update (B A)^T): the modules are the mapping's HF weight
names without `.weight` (`model.layers.l.self_attn.q_proj`, `...block_sparse_moe.experts.e.w1`,
`...block_sparse_moe.gate`, `model.embed_tokens`, `lm_head`). A fused megatron adapter is one A
shared by its parts, B split by rows: linear_qkv -> q/k/v (per query group interleave),
linear_fc1 -> w1 (rows 0..f), w3 (rows f..2f). Padded vocabulary rows/columns (V..Vp) are dropped
on export and zero on import. Experts a checkpoint fuses per layer (GPT-OSS:
`mlp.experts.gate_up_proj`) still have one site per expert, its one part a
`convert.fused_experts.OneExpert` named `...mlp.experts.{e}.gate_up_proj` (not a transformers
module: PEFT's adapter is the layer's fused parameter, export/peft_fused.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from megatron_lora.convert.fused_experts import FusedExperts, OneExpert
from megatron_lora.convert.mapping import QKV, Direct, Zeros, mcore_tensors
from megatron_lora.convert.sources import RopeRows
from megatron_lora.families import ModelInfo
from megatron_lora.families.shape import MLA_INPUTS

PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class Kind:
    """One adapter kind: the base weight's mapping key and the checkpoint keys of its factors."""

    name: str
    base_key: str
    prefix: str  # checkpoint keys are prefix + "lora_A" / "lora_B"
    lead: int  # leading (layer, expert) axes of the stacked checkpoint tensors
    target: str = ""  # the LoraConfig target kind it belongs to ("" = its name)

    @property
    def target_kind(self) -> str:
        return self.target or self.name

    @property
    def a_key(self) -> str:
        return self.prefix + "lora_A"

    @property
    def b_key(self) -> str:
        return self.prefix + "lora_B"

    @property
    def m_key(self) -> str:
        """DoRA's magnitude vector (global [*lead, out], the base weight's rows)."""
        return self.prefix + "lora_magnitude_vector"


KINDS: Tuple[Kind, ...] = (
    Kind("embedding", "embedding.word_embeddings.weight", "embedding.word_embeddings.", 0),
    Kind("linear_qkv", "decoder.layers.self_attention.linear_qkv.weight",
         "decoder.layers.self_attention.linear_qkv.", 1),
    Kind("linear_proj", "decoder.layers.self_attention.linear_proj.weight",
         "decoder.layers.self_attention.linear_proj.", 1),
    Kind("router", "decoder.layers.mlp.router.weight", "decoder.layers.mlp.router.lora.", 1),
    Kind("linear_fc1", "decoder.layers.mlp.experts.experts.linear_fc1.weight",
         "decoder.layers.mlp.experts.experts.linear_fc1.", 2),
    Kind("linear_fc2", "decoder.layers.mlp.experts.experts.linear_fc2.weight",
         "decoder.layers.mlp.experts.experts.linear_fc2.", 2),
    Kind("output_layer", "output_layer.weight", "output_layer.", 0),
    Kind("shared_fc1", "decoder.layers.mlp.shared_experts.linear_fc1.weight",
         "decoder.layers.mlp.shared_experts.linear_fc1.", 1, "linear_fc1"),
    Kind("shared_fc2", "decoder.layers.mlp.shared_experts.linear_fc2.weight",
         "decoder.layers.mlp.shared_experts.linear_fc2.", 1, "linear_fc2"),
    Kind("dense_fc1", "decoder.layers.mlp.linear_fc1.weight", "decoder.layers.mlp.linear_fc1.", 1,
         "linear_fc1"),
    Kind("dense_fc2", "decoder.layers.mlp.linear_fc2.weight", "decoder.layers.mlp.linear_fc2.", 1,
         "linear_fc2"),
) + tuple(  # multi-latent attention's input projections: the linear_qkv target there
    Kind(name, f"decoder.layers.self_attention.{name}.weight",
         f"decoder.layers.self_attention.{name}.", 1, "linear_qkv")
    for name in MLA_INPUTS)
KIND_BY_NAME: Dict[str, Kind] = {k.name: k for k in KINDS}
# re.search patterns selecting one kind among megatron's global adapter names (LoraConfig patterns)
KIND_PATTERN: Dict[str, str] = {
    "embedding": r"^embedding$",
    "linear_qkv": r"self_attention\.linear_qkv$",
    "linear_proj": r"self_attention\.linear_proj$",
    "router": r"mlp\.router$",
    "linear_fc1": r"experts\.\d+\.linear_fc1$",
    "linear_fc2": r"experts\.\d+\.linear_fc2$",
    "output_layer": r"^output_layer$",
    "shared_fc1": r"shared_experts\.linear_fc1$",
    "shared_fc2": r"shared_experts\.linear_fc2$",
    "dense_fc1": r"layers\.\d+\.mlp\.linear_fc1$",
    "dense_fc2": r"layers\.\d+\.mlp\.linear_fc2$",
    **{name: rf"self_attention\.{name}$" for name in MLA_INPUTS},
}


def module_of(weight_name: str) -> str:
    """HF module name of an HF weight name (`...q_proj.weight` -> `...q_proj`)."""
    return weight_name[: -len(".weight")]


def short_name(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def hf_short(info: ModelInfo, kind: Kind) -> Tuple[str, ...]:
    """PEFT `target_modules` names of `kind` in `info`'s family (`q_proj`, `w1`, ...); a
    multi-latent attention projection's is its one HF module's (`kv_b_proj`)."""
    names = info.family.names.kind_modules()[kind.target_kind]
    if kind.target_kind == "linear_qkv" and kind.name != "linear_qkv":
        base = {t.key: t for t in mcore_tensors(info, stacked=True)}[kind.base_key]
        return tuple(dict.fromkeys(short_name(module_of(n))
                                   for n in base.chunks[0].source.hf_shapes()))
    return names


@dataclass(frozen=True)
class Part:
    """Rows [row0, row0 + rows) of a megatron B (the base weight's rows) and where they go.

    source: the mapping's chunk source: `Direct` (one HF module), `QKV` (q, k, v interleaved per
    query group) or `Zeros` (padded vocabulary rows: dropped on export, zero on import)."""

    row0: int
    rows: int
    source: object

    def modules(self) -> List[str]:
        return [module_of(n) for n in self.source.hf_shapes()]


@dataclass(frozen=True)
class Site:
    """One megatron adapter: its checkpoint box and global name, and the HF modules it covers."""

    kind: Kind
    index: Tuple[int, ...]  # (layer,) or (layer, expert) or ()
    name: str  # global adapter name (lora/identity.py), the key LoraConfig patterns search
    parts: Tuple[Part, ...]  # ordered by row0; cover all B rows

    def modules(self) -> List[str]:
        return [m for p in self.parts for m in p.modules()]

    @property
    def out_features(self) -> int:
        return sum(p.rows for p in self.parts)


def _global_name(kind: str, index: Tuple[int, ...]) -> str:
    if kind in ("embedding", "output_layer"):
        return kind
    layer = f"decoder.layers.{index[0]}"
    if kind in MLA_INPUTS:
        return f"{layer}.self_attention.{kind}"
    return {
        "linear_qkv": f"{layer}.self_attention.linear_qkv",
        "linear_proj": f"{layer}.self_attention.linear_proj",
        "router": f"{layer}.mlp.router",
        "linear_fc1": f"{layer}.mlp.experts.{index[-1]}.linear_fc1",
        "linear_fc2": f"{layer}.mlp.experts.{index[-1]}.linear_fc2",
        "shared_fc1": f"{layer}.mlp.shared_experts.linear_fc1",
        "shared_fc2": f"{layer}.mlp.shared_experts.linear_fc2",
        "dense_fc1": f"{layer}.mlp.linear_fc1",
        "dense_fc2": f"{layer}.mlp.linear_fc2",
    }[kind]


def model_kinds(info: ModelInfo) -> Tuple[Kind, ...]:
    """The kinds whose base weight `info`'s model has (shared experts only where it has them)."""
    keys = {t.key for t in mcore_tensors(info, stacked=True)}
    return tuple(k for k in KINDS if k.base_key in keys)


def sites(info: ModelInfo, kind: Kind) -> List[Site]:
    """Every adapter of `kind` in the model, in checkpoint order (layer, then expert)."""
    base = {t.key: t for t in mcore_tensors(info, stacked=True)}[kind.base_key]
    groups: Dict[Tuple[int, ...], List[Part]] = {}
    for c in base.chunks:
        if isinstance(c.source, FusedExperts):  # a layer's experts in one chunk: one site each
            for e in range(c.sizes[1]):
                one = OneExpert(c.source, e)
                groups[(c.offsets[0], c.offsets[1] + e)] = [Part(0, one.shape[0], one)]
            continue
        lead = tuple(c.offsets[: kind.lead])
        rows = c.sizes[kind.lead] if isinstance(c.source, Zeros) else c.source.shape[0]
        groups.setdefault(lead, []).append(Part(c.offsets[kind.lead], rows, c.source))
    return [Site(kind, idx, _global_name(kind.name, idx), tuple(sorted(p, key=lambda q: q.row0)))
            for idx, p in sorted(groups.items())]


def in_features(info: ModelInfo, kind: Kind) -> int:
    """Columns of the base weight (A's columns); for the embedding, the padded vocabulary."""
    base = {t.key: t for t in mcore_tensors(info, stacked=True)}[kind.base_key]
    return base.shape[-1] if kind.name != "embedding" else base.shape[0]


def factor_shapes(info: ModelInfo, kind: Kind, rank: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Global checkpoint shapes (A, B) of `kind` at rank `rank`."""
    base = {t.key: t for t in mcore_tensors(info, stacked=True)}[kind.base_key]
    lead = tuple(base.shape[: kind.lead])
    if kind.name == "embedding":
        return (rank, base.shape[0]), (base.shape[1], rank)
    return lead + (rank, base.shape[-1]), lead + (base.shape[kind.lead], rank)


class _DictReader:
    """The `read(name, index)` a mapping source expects, over a dict of HF-side tensors."""

    def __init__(self, tensors: Dict[str, torch.Tensor]):
        self.tensors = tensors

    def read(self, name: str, index=None) -> torch.Tensor:
        t = self.tensors[name]
        return t if index is None else t[index]


def _with_columns(source, r: int):
    """The same row split as `source`, for a tensor with r columns instead of the weight's."""
    if isinstance(source, QKV):
        return QKV(*source.names, source.qpg * source.groups, source.groups, source.d, r)
    if isinstance(source, Direct):
        return Direct(source.name, (source.shape[0], r))
    if isinstance(source, Zeros):
        return Zeros((source.shape[0], r), torch.float32)
    if isinstance(source, RopeRows):
        return RopeRows(source.name, (source.shape[0], r), source.groups, source.lead,
                        source.to_mcore, source.to_hf)
    # OneExpert: a fused parameter's adapter is PEFT's one pair a layer (export/peft_fused.py)
    raise TypeError(f"{type(source).__name__} rows are not split per HF module")


def split_rows(part: Part, b_rows: torch.Tensor) -> Dict[str, torch.Tensor]:
    """{HF module: its rows of B} for this part's rows `b_rows` [rows, r] (none for padding)."""
    src = _with_columns(part.source, b_rows.shape[1])
    return {module_of(n): t for n, t in src.split(b_rows).items()}


def fuse_rows(part: Part, by_module: Dict[str, torch.Tensor], r: int, dtype) -> torch.Tensor:
    """The inverse of split_rows: this part's [rows, r] of B from each module's rows."""
    if isinstance(part.source, Zeros):
        return torch.zeros(part.rows, r, dtype=dtype, device="cpu")
    src = _with_columns(part.source, r)
    reader = _DictReader({m + ".weight": t for m, t in by_module.items()})
    return src.read(reader, (slice(0, part.rows), slice(0, r))).reshape(part.rows, r)


def magnitude_shape(info: ModelInfo, kind: Kind) -> Tuple[int, ...]:
    """Global checkpoint shape of `kind`'s DoRA magnitude: the base weight's leading axes and
    rows."""
    base = {t.key: t for t in mcore_tensors(info, stacked=True)}[kind.base_key]
    return tuple(base.shape[: kind.lead + 1])


def peft_magnitude_key(module: str) -> str:
    """PEFT's safetensors key of an HF module's DoRA magnitude vector ([out])."""
    return PEFT_PREFIX + module + ".lora_magnitude_vector"


def peft_keys(module: str, embedding: bool) -> Tuple[str, str]:
    """PEFT safetensors keys (A, B) of an HF module in the per-expert layout."""
    if embedding:
        return PEFT_PREFIX + module + ".lora_embedding_A", PEFT_PREFIX + module + ".lora_embedding_B"
    return PEFT_PREFIX + module + ".lora_A.weight", PEFT_PREFIX + module + ".lora_B.weight"
