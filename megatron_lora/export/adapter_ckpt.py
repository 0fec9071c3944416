"""Adapter checkpoints (what `megatron-lora train` saves) read and written without a model.

Reading: `AdapterCheckpoint(path)` opens an iteration folder (or a run folder, through its
tracker) with `convert.dcp_read.TorchDistCheckpoint` (no torch.distributed, no pickled code),
takes the LoraConfig from `common.pt` (`run_metadata.lora`, LoraConfig.to_dict()) and, given the
model's ModelInfo, checks the base it records against that model (`run_metadata.base`,
lora/adapter_base.py: another family or other sizes are refused unless allow_other_base) and
every adapter tensor against the table (`table.KINDS`): known key, both factors present, global
shapes as the config implies. Optimizer entries are ignored.

Writing: `write_adapter_checkpoint` writes the same format from per-adapter factors produced on
demand (one adapter's factors in memory at a time), into a directory that appears only when
complete. It holds only the model's adapter tensors (no optimizer state), one chunk per adapter
box (layer, or layer x expert), and `common.pt` = {"common": {"iteration": 0, "run_metadata":
{"lora": LoraConfig.to_dict(), "base": base_record(info), ...}}}, so
`training.checkpoint.load_adapter_weights` loads it at any layout after
`apply_lora(model, lora_config_from_dict(...))`.

Prefix tuning (LoraConfig.num_virtual_tokens = n > 0, lora/prefix.py) has no factors; its tensors
(td = groups * head_dim, L layers, enc the encoder hidden size):

    decoder.layers.self_attention.core_attention.prefix_kv           [L, n, 2, groups, head_dim]
  or, with prefix_projection (P_l = tanh(E W1^T + b1) W2_l^T + b2_l):
    decoder.layers.self_attention.core_attention.prefix_proj_weight  [L, 2, groups, head_dim, enc]
    decoder.layers.self_attention.core_attention.prefix_proj_bias    [L, 2, groups, head_dim]
    prefix_encoder.embedding [n, td] (E), prefix_encoder.weight [enc, td] (W1), .bias [enc] (b1)

`AdapterCheckpoint.prefix_table()` gives PEFT's table [n, L * 2 * td] (row i: layer 0's key, layer
0's value, layer 1's key, ...; each [groups, head_dim], megatron's query group g = HF kv head g),
and `write_adapter_checkpoint(..., extra=prefix_tensors(info, table))` writes such a table back
(prefix_projection=False).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Dict, List, Tuple

import torch

from megatron_lora.convert.atomic import atomic_directory, check_output_free
from megatron_lora.convert.dcp_read import TorchDistCheckpoint
from megatron_lora.convert.dcp_write import write_torch_dist
from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.layer_keys import StackedView, stacked_key, unstack, unstack_whole
from megatron_lora.convert.mapping import Chunk, McoreTensor
from megatron_lora.export.table import (KINDS, Kind, factor_shapes, magnitude_shape, model_kinds,
                                        sites)
from megatron_lora.jsonfile import reason
from megatron_lora.lora.adapter_base import AdapterBaseError, base_record, check_base, say_once
from megatron_lora.lora.model import LoraConfig
from megatron_lora.families import ModelInfo
from megatron_lora.runtime.safe_load import CheckpointFileError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Trainable tokens (LoraConfig.trainable_token_indices): [n, h] rows of the word embedding and of
# the output layer (lora/trainable_tokens.py), by checkpoint key.
TOKEN_KEYS = {"embedding": "embedding.word_embeddings.trainable_tokens_delta",
              "output_layer": "output_layer.trainable_tokens_delta"}
# Prefix tuning's tensors (see the module docstring), by checkpoint key.
_CORE = "decoder.layers.self_attention.core_attention."
PREFIX_KV = _CORE + "prefix_kv"
PREFIX_W2, PREFIX_B2 = _CORE + "prefix_proj_weight", _CORE + "prefix_proj_bias"
ENCODER_E, ENCODER_W1, ENCODER_B1 = ("prefix_encoder.embedding", "prefix_encoder.weight",
                                     "prefix_encoder.bias")


def prefix_shapes(info: ModelInfo, config: LoraConfig) -> Dict[str, Tuple[int, ...]]:
    """{checkpoint key: global shape} of a prefix-tuning config's tensors for the model `info`."""
    s = info.shape
    L, n, g, d = s.num_layers, config.num_virtual_tokens, s.num_query_groups, info.head_dim
    if not config.prefix_projection:
        return {PREFIX_KV: (L, n, 2, g, d)}
    enc = config.encoder_hidden_size or g * d
    return {PREFIX_W2: (L, 2, g, d, enc), PREFIX_B2: (L, 2, g, d), ENCODER_E: (n, g * d),
            ENCODER_W1: (enc, g * d), ENCODER_B1: (enc,)}


def prefix_tensors(info: ModelInfo, table: torch.Tensor) -> Dict[str, torch.Tensor]:
    """PEFT's prefix table [n, L * 2 * td] -> {PREFIX_KV: [L, n, 2, groups, head_dim]} (a view
    permuted; values unchanged), for write_adapter_checkpoint's `extra`."""
    s = info.shape
    L, g, d = s.num_layers, s.num_query_groups, info.head_dim
    n = table.shape[0]
    return {PREFIX_KV: table.reshape(n, L, 2, g, d).permute(1, 0, 2, 3, 4)}


def lora_config_from_dict(d: dict, source: str = "run metadata") -> LoraConfig:
    """LoraConfig from LoraConfig.to_dict() output (dtype by name); ConversionError if invalid."""
    names = {f.name for f in dataclasses.fields(LoraConfig)}
    if not isinstance(d, dict):
        raise ConversionError(f"{source}: LoRA config is not a dict: {d!r}")
    unknown = sorted(set(d) - names)
    if unknown:
        raise ConversionError(f"{source}: unknown LoRA config fields {unknown}")
    kw = dict(d)
    if kw.get("dtype") is not None:
        if kw["dtype"] not in _DTYPES:
            raise ConversionError(f"{source}: LoRA dtype {kw['dtype']!r} is not one of {sorted(_DTYPES)}")
        kw["dtype"] = _DTYPES[kw["dtype"]]
    try:
        return LoraConfig(**kw)
    except ValueError as exc:
        raise ConversionError(f"{source}: {exc}") from None


class AdapterCheckpoint:
    """An adapter checkpoint opened for streamed reading; see the module docstring."""

    def __init__(self, path: str, info: ModelInfo, allow_other_base: bool = False):
        from megatron_lora.lora.run_files import read_run_metadata, resolve

        try:
            self.directory = resolve(path)
        except (OSError, ValueError) as exc:
            raise ConversionError(str(exc)) from None
        self.info = info
        self.ckpt = TorchDistCheckpoint(self.directory)
        if info.shape.per_layer_keys:  # read through the table's stacked keys
            self.ckpt = StackedView(self.ckpt, info.shape.num_layers)
        common_path = os.path.join(self.directory, "common.pt")
        try:
            self.common = read_run_metadata(self.directory)
        except CheckpointFileError as exc:  # its message already names the file
            raise ConversionError(str(exc)) from None
        except Exception as exc:
            raise ConversionError(f"{common_path}: cannot read the run metadata: "
                                  f"{reason(exc)}") from None
        lora = (self.common.get("run_metadata") or {}).get("lora")
        if lora is None:
            raise ConversionError(f"{common_path}: no run_metadata.lora (not an adapter checkpoint)")
        self.config = lora_config_from_dict(lora, common_path)
        try:  # the base it was trained on (lora/adapter_base.py), before its tensors
            self.base_note = check_base(self.common.get("run_metadata"), info,
                                        f"adapter {self.directory}", allow_other_base)
        except AdapterBaseError as exc:
            raise ConversionError(str(exc)) from None
        say_once(self.base_note)
        if self.config.num_virtual_tokens:  # prefix tuning: no factors
            self.ranks: Dict[str, int] = {}
            keys = self._check_prefix()
        else:
            self.ranks = self._check_tensors()
            keys = [k.a_key for k in self.kinds()] + [k.b_key for k in self.kinds()]
        dtypes = {self.ckpt.dtype(k) for k in keys}
        if len(dtypes) != 1:
            raise ConversionError(f"{self.directory}: adapter tensors have mixed dtypes "
                                  f"{sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop()

    def kinds(self) -> Tuple[Kind, ...]:
        return tuple(k for k in KINDS if k.name in self.ranks)

    def _check_tensors(self) -> Dict[str, int]:
        keys = {k for k in self.ckpt.tensors if not k.startswith("optimizer.")}
        kinds = model_kinds(self.info)
        known = {k.a_key: k for k in kinds} | {k.b_key: k for k in kinds}
        if self.config.use_dora:  # DoRA magnitudes, one per factor pair
            known |= {k.m_key: k for k in kinds}
        tokens = self.config.trainable_token_indices
        if tokens:
            known |= {key: None for key in TOKEN_KEYS.values()}
            want = (len(tokens), self.info.shape.hidden_size)
            for key in TOKEN_KEYS.values():
                if key not in keys:
                    raise ConversionError(f"{self.directory}: the LoRA config has "
                                          f"trainable_token_indices (--add-special-tokens) but "
                                          f"tensor {key} is missing")
                if tuple(self.ckpt.shape(key)) != want:
                    raise ConversionError(f"{self.directory}: tensor {key} has shape "
                                          f"{list(self.ckpt.shape(key))}, the config implies "
                                          f"{list(want)}")
        unknown = sorted(keys - set(known))
        if unknown:
            raise ConversionError(f"{self.directory}: tensors that are not LoRA factors of this "
                                  f"model: {unknown[:5]}")
        ranks = {}
        for kind in kinds:
            has = [key in keys for key in (kind.a_key, kind.b_key)]
            if not any(has):
                continue
            if not all(has):
                missing = kind.b_key if has[0] else kind.a_key
                raise ConversionError(f"{self.directory}: tensor {missing} is missing")
            a_shape = self.ckpt.shape(kind.a_key)
            rank = a_shape[kind.lead] if len(a_shape) > kind.lead else -1
            want = factor_shapes(self.info, kind, rank)
            for key, got, exp in ((kind.a_key, a_shape, want[0]),
                                  (kind.b_key, self.ckpt.shape(kind.b_key), want[1])):
                if tuple(got) != tuple(exp):
                    raise ConversionError(
                        f"{self.directory}: tensor {key} has shape {list(got)}, but the model "
                        f"({self.info.config_fields()}) at rank {rank} implies {list(exp)}")
            self._check_layers(kind)
            if self.config.use_dora:
                want_m = magnitude_shape(self.info, kind)
                if kind.m_key not in keys:
                    raise ConversionError(f"{self.directory}: the LoRA config has use_dora "
                                          f"(--lora-use-dora) but tensor {kind.m_key} is missing")
                if tuple(self.ckpt.shape(kind.m_key)) != want_m:
                    raise ConversionError(
                        f"{self.directory}: tensor {kind.m_key} has shape "
                        f"{list(self.ckpt.shape(kind.m_key))}, the model implies {list(want_m)}")
            ranks[kind.name] = rank
        if not ranks:
            raise ConversionError(f"{self.directory}: no LoRA factors in the checkpoint")
        return ranks

    def _check_layers(self, kind: Kind) -> None:
        """A checkpoint keyed per layer holds a kind's factors on exactly the layers the model
        has that kind on (the dense MLP's on dense layers, the experts' on MoE layers)."""
        if not isinstance(self.ckpt, StackedView) or not kind.lead:
            return
        want = sorted({s.index[0] for s in sites(self.info, kind)})
        for key in (kind.a_key, kind.b_key):
            got = self.ckpt.layers.get(key, [])
            if got != want:
                raise ConversionError(f"{self.directory}: tensor {key} is stored for layers "
                                      f"{got}, but the model has it on layers {want}")

    def _check_prefix(self) -> List[str]:
        """The prefix tensors' keys, each checked present with the shape the model and the
        config imply; anything else (LoRA factors, other tensors) refused."""
        want = prefix_shapes(self.info, self.config)
        keys = {k for k in self.ckpt.tensors if not k.startswith("optimizer.")}
        cfg = self.config
        setting = (f"num_virtual_tokens={cfg.num_virtual_tokens}, prefix_projection="
                   f"{cfg.prefix_projection}, encoder_hidden_size={cfg.encoder_hidden_size}")
        for key, shape in want.items():
            if key not in keys:
                raise ConversionError(f"{self.directory}: the LoRA config is prefix tuning "
                                      f"({setting}) but tensor {key} is missing")
            got = tuple(self.ckpt.shape(key))
            if got != shape:
                raise ConversionError(
                    f"{self.directory}: tensor {key} has shape {list(got)}, but the model "
                    f"({self.info.config_fields()}) with {setting} implies {list(shape)}")
        unknown = sorted(keys - set(want))
        if unknown:
            raise ConversionError(f"{self.directory}: a prefix-tuning checkpoint ({setting}) "
                                  f"with other tensors: {unknown[:5]}")
        return list(want)

    def _whole(self, key: str) -> torch.Tensor:
        shape = tuple(self.ckpt.shape(key))
        return self.ckpt.read(key, (0,) * len(shape), shape)

    def prefix_table(self) -> torch.Tensor:
        """PEFT's prefix table [n, L * 2 * td]: row i is virtual token i's keys and values of
        every layer (layer l's key [groups, head_dim] at columns [2 l td, (2 l + 1) td), its
        value after it). Without projection the stored values in the checkpoint dtype, bit for
        bit; with projection tanh(E W1^T + b1) W2^T + b2 computed in fp32 (float32), one layer's
        W2 read at a time."""
        if not self.config.num_virtual_tokens:
            raise ConversionError(f"{self.directory}: not a prefix-tuning checkpoint")
        L, n = self.info.shape.num_layers, self.config.num_virtual_tokens
        if not self.config.prefix_projection:
            kv = self._whole(PREFIX_KV)  # [L, n, 2, g, d]
            return kv.permute(1, 0, 2, 3, 4).reshape(n, -1).contiguous()
        e, w1, b1 = (self._whole(k).float() for k in (ENCODER_E, ENCODER_W1, ENCODER_B1))
        hidden = torch.tanh(torch.nn.functional.linear(e, w1, b1))  # [n, enc]
        w_shape, b_shape = self.ckpt.shape(PREFIX_W2), self.ckpt.shape(PREFIX_B2)
        layers = []
        for layer in range(L):
            w2 = self.ckpt.read(PREFIX_W2, (layer, 0, 0, 0, 0), (1,) + tuple(w_shape[1:]))
            b2 = self.ckpt.read(PREFIX_B2, (layer, 0, 0, 0), (1,) + tuple(b_shape[1:]))
            w2 = w2.float().reshape(-1, hidden.shape[1])  # [2 td, enc]: key rows, value rows
            layers.append(torch.nn.functional.linear(hidden, w2, b2.float().reshape(-1)))
        return torch.cat(layers, dim=1)  # [n, L * 2 td]

    def token_rows(self, which: str) -> torch.Tensor:
        """The trained rows [n, h] of `which` ("embedding" or "output_layer") for the ids
        config.trainable_token_indices, in the checkpoint dtype."""
        key = TOKEN_KEYS[which]
        shape = tuple(self.ckpt.shape(key))
        return self.ckpt.read(key, (0,) * len(shape), shape)

    def factors(self, site) -> Tuple[torch.Tensor, torch.Tensor]:
        """(A [r, in], B [out, r]) of one adapter, in the checkpoint dtype (embedding: A [r, Vp],
        B [h, r])."""
        kind = site.kind
        out = []
        for key in (kind.a_key, kind.b_key):
            shape = self.ckpt.shape(key)
            offsets = tuple(site.index) + (0,) * (len(shape) - kind.lead)
            sizes = (1,) * kind.lead + tuple(shape[kind.lead:])
            out.append(self.ckpt.read(key, offsets, sizes).reshape(shape[kind.lead:]))
        return out[0], out[1]

    def magnitude(self, site) -> torch.Tensor:
        """DoRA's magnitude m [out] of one adapter (the base weight's rows), checkpoint dtype."""
        kind = site.kind
        shape = self.ckpt.shape(kind.m_key)
        sizes = (1,) * kind.lead + tuple(shape[kind.lead:])
        return self.ckpt.read(kind.m_key, tuple(site.index) + (0,), sizes).reshape(-1)

    def scaling(self, site) -> Tuple[int, float, float]:
        """(rank, alpha, scale) of an adapter from the checkpoint's LoraConfig; ConversionError if
        the config's rank disagrees with the stored factors."""
        cfg = self.config.adapter_config(site.name)
        if cfg.rank != self.ranks[site.kind.name]:
            raise ConversionError(
                f"{self.directory}: the LoRA config gives {site.name} rank {cfg.rank}, the stored "
                f"{site.kind.a_key} has rank {self.ranks[site.kind.name]}")
        return cfg.rank, float(cfg.alpha), cfg.scaling


FactorFn = Callable[[object], Tuple[torch.Tensor, torch.Tensor]]


def write_adapter_checkpoint(save: str, info: ModelInfo, ranks: Dict[str, int], factors: FactorFn,
                             config: LoraConfig, dtype: torch.dtype, run_metadata: dict = None,
                             overwrite: bool = False,
                             extra: Dict[str, torch.Tensor] = None) -> None:
    """Write an adapter checkpoint at `save` (atomically).

    ranks: {kind name: rank} of the kinds to write. factors(site) -> (A, B) with the shapes of one
    site's box (embedding: A [r, Vp], B [h, r]), called once per factor per site; with
    config.use_dora it returns (A, B, m), m [out] the DoRA magnitude. extra: whole tensors by
    checkpoint key (one chunk each, replicated), e.g. the trainable tokens' rows (TOKEN_KEYS).
    A prefix-tuning config (num_virtual_tokens > 0) takes no ranks and exactly its tensors in
    `extra` (prefix_shapes; prefix_tensors(info, table) without projection).
    """
    if config.num_virtual_tokens:
        want = prefix_shapes(info, config)
        got = {k: tuple(v.shape) for k, v in (extra or {}).items()}
        if ranks or got != want:
            raise ValueError(f"a prefix-tuning checkpoint takes no LoRA ranks (got {ranks}) and "
                             f"the tensors {want} as extra, got {got}")
    check_output_free(save, overwrite)
    tensors = []
    by_key: Dict[str, Tuple[Kind, int]] = {}
    site_of: Dict[Tuple[str, Tuple[int, ...]], object] = {}
    for kind in KINDS:
        if kind.name not in ranks:
            continue
        a_shape, b_shape = factor_shapes(info, kind, ranks[kind.name])
        todo = [(0, kind.a_key, a_shape), (1, kind.b_key, b_shape)]
        if config.use_dora:
            todo.append((2, kind.m_key, magnitude_shape(info, kind)))
        for which, key, shape in todo:
            chunks = []
            for s in sites(info, kind):
                offsets = tuple(s.index) + (0,) * (len(shape) - kind.lead)
                sizes = (1,) * kind.lead + tuple(shape[kind.lead:])
                chunks.append(Chunk(offsets, sizes, None))
                site_of[(key, offsets)] = s
            tensors.append(McoreTensor(key, tuple(shape), tuple(chunks)))
            by_key[key] = (kind, which)

    per_layer = info.shape.per_layer_keys  # megatron keys such a model's layers one by one
    if per_layer:
        tensors, extra = unstack(tensors), unstack_whole(extra or {})
    for key, value in (extra or {}).items():
        tensors.append(McoreTensor(key, tuple(value.shape), (Chunk((0,) * value.dim(),
                                                                   tuple(value.shape), None),)))

    def chunk_data(t: McoreTensor, c: Chunk) -> torch.Tensor:
        if t.key in (extra or {}):
            return extra[t.key].to(dtype).contiguous()
        key, offsets = stacked_key(t.key, c.offsets) if per_layer else (t.key, tuple(c.offsets))
        kind, which = by_key[key]
        data = factors(site_of[(key, offsets)])[which]
        return data.to(dtype).reshape(c.sizes).contiguous()

    common = {"iteration": 0, "consumed_samples": 0, "layout": None, "world_size": None,
              "run_metadata": dict(run_metadata or {}, lora=config.to_dict(),
                                   base=base_record(info))}
    with atomic_directory(save, overwrite) as tmp:
        write_torch_dist(tmp, tensors, [], chunk_data, dtype)
        torch.save({"common": common}, os.path.join(tmp, "common.pt"))
