"""The tensors of a PEFT LoRA `adapter_model.safetensors`, parsed and checked.

Accepted keys (`base_model.model.` + module + `.lora_A.weight` / `.lora_B.weight`, the embedding
`.lora_embedding_A` / `.lora_embedding_B`):

Module names are the family's (`info.family.names`, with its `module_aliases` accepted too);
the table shows Mixtral's.

| module (transformers 4 per-expert names; `mlp.` accepted for `block_sparse_moe.`) | factors |
|---|---|
| model.layers.L.self_attn.{q,k,v,o}_proj                 | A [r, in], B [out, r] |
| model.layers.L.block_sparse_moe.experts.E.{w1,w2,w3}    | A [r, in], B [out, r] |
| model.layers.L.block_sparse_moe.gate                    | A [r, h], B [E, r]    |
| model.layers.L.mlp.{gate,up,down}_proj (dense layers between MoE layers) | A [r, in], B [out, r] |
| model.embed_tokens (lora_embedding_A [r, V], lora_embedding_B [h, r]) | update (B A)^T |
| lm_head                                                 | A [r, h], B [V, r]    |
| transformers 5 fused: model.layers.L.mlp.experts[.base_layer] (gate_up_proj / down_proj, told apart by shape) | A [E r, in] (expert-major rows), B [out, E r] (column j = rank j // E of expert j % E) |

DoRA (`use_dora: true`): `...{q,k,v,o}_proj.lora_magnitude_vector` [out] for every adapted module
(`magnitudes`); DoRA on other modules is refused.

`*.base_layer.weight` copies of embed_tokens / lm_head (PEFT saves them when it targets embedding
layers) are skipped if they have the base model's shape. Anything else, a wrong shape or a layer
or expert outside the model is a ConversionError naming the file and the key.

Prefix tuning (PEFT's PREFIX_TUNING): one tensor `prompt_embeddings` [n, L * 2 * td]
(`read_prefix_table`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from safetensors import safe_open

from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.mapping import hf_shapes
from megatron_lora.export.peft_config import (WEIGHTS_NAME, PeftLora, PeftPrefix, scale,
                                              unmatched_targets)
from megatron_lora.families import ModelInfo
from megatron_lora.runtime.folder_files import folder_file

_PREFIX = "base_model.model."
_FACTOR = re.compile(r"^(?P<module>.+)\.(?:(?P<lin>lora_[AB])\.weight|(?P<emb>lora_embedding_[AB]))$")
_FUSED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts(?:\.base_layer)*$")
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_SKIPPABLE = ("model.embed_tokens.base_layer.weight", "lm_head.base_layer.weight")
# Trainable tokens (trainable_token_indices): the rows, and PEFT's copies of the (resized) base.
TOKEN_ROWS = {"embedding": "model.embed_tokens.token_adapter.trainable_tokens_delta",
              "output_layer": "lm_head.token_adapter.trainable_tokens_delta"}
_TOKEN_BASE = ("model.embed_tokens.token_adapter.base_layer.weight",
               "lm_head.token_adapter.base_layer.weight")
_MAGNITUDE = ".lora_magnitude_vector"


@dataclass
class Factor:
    """One PEFT LoRA pair: keys, rank, and the (r, alpha) scale PEFT gives it."""

    a_key: Optional[str] = None
    b_key: Optional[str] = None
    rank: int = 0
    scale: float = 0.0
    alpha: float = 0.0


PROMPT_EMBEDDINGS = "prompt_embeddings"


def _weights_path(directory: str) -> str:
    path = folder_file(directory, WEIGHTS_NAME, ConversionError)  # no symlink out of the folder
    if not os.path.isfile(path):
        other = os.path.join(directory, "adapter_model.bin")
        extra = " (adapter_model.bin, a pickle, is not read: convert it to safetensors)" \
            if os.path.isfile(other) else ""
        raise ConversionError(f"{path}: file not found{extra}")
    return path


def read_prefix_table(directory: str, info: ModelInfo, config: PeftPrefix) -> torch.Tensor:
    """PEFT's prefix table [n, L * 2 * td] from `directory/adapter_model.safetensors`, after
    checking `config` (adapter_config.json) against the model (td = kv heads x head_dim, PEFT's
    GQA token_dim) and the file against `config`: one tensor `prompt_embeddings`, that shape,
    fp32 / bf16 / fp16."""
    s = info.shape
    want = {"num_layers": s.num_layers, "num_attention_heads": s.num_query_groups,
            "token_dim": s.num_query_groups * info.head_dim}
    for name, value in want.items():
        if getattr(config, name) != value:
            raise ConversionError(
                f"{config.path}: field {name}={getattr(config, name)}, but the model "
                f"({info.config_fields()}) has {value} (PEFT: token_dim = num_key_value_heads x "
                f"head_dim, num_attention_heads = num_key_value_heads)")
    path = _weights_path(directory)
    shape = (config.num_virtual_tokens, s.num_layers * 2 * want["token_dim"])
    try:
        with safe_open(path, framework="pt") as f:
            keys = list(f.keys())
            if keys != [PROMPT_EMBEDDINGS]:
                raise ConversionError(f"{path}: a PREFIX_TUNING adapter holds one tensor "
                                      f"{PROMPT_EMBEDDINGS!r}, found {sorted(keys)[:5]}")
            sl = f.get_slice(PROMPT_EMBEDDINGS)
            if tuple(sl.get_shape()) != shape or sl.get_dtype() not in _DTYPES:
                raise ConversionError(
                    f"{path}: tensor {PROMPT_EMBEDDINGS!r} is {sl.get_dtype()} "
                    f"{list(sl.get_shape())}; {config.path} (num_virtual_tokens="
                    f"{config.num_virtual_tokens}) and the model imply {list(shape)} in F32, "
                    f"BF16 or F16")
            return check_finite(path, PROMPT_EMBEDDINGS, f.get_tensor(PROMPT_EMBEDDINGS))
    except ConversionError:
        raise
    except Exception as exc:
        raise ConversionError(f"{path}: not a readable safetensors file (truncated or "
                              f"corrupt?): {exc}") from None


def _template(template: str) -> str:
    """Regex of an HFNames template: `{l}` and `{e}` become (\\d+) groups, the rest is literal."""
    out = re.escape(template)
    for key in ("{l}", "{e}"):
        out = out.replace(re.escape(key), r"(\d+)")
    return out


class _ModuleNames:
    """A family's per-layer PEFT module names as regexes, and their canonical (on-disk) form."""

    def __init__(self, family):
        n, self.aliases = family.names, family.module_aliases
        mod = lambda w: re.escape(w[: -len(".weight")])  # noqa: E731
        self.layer, self.expert, self.router = n.layer, n.layer + n.expert, n.layer + n.router
        self.attn = re.compile(f"^{_template(n.layer)}({'|'.join(mod(w) for w in n.attention_linears())})$")
        self.experts = re.compile(f"^{_template(self.expert)}("
                                  f"{'|'.join(mod(w) for w in (n.expert_gate, n.expert_up, n.expert_down))})$")
        self.gate = re.compile(f"^{_template(self.router[: -len('.weight')])}$")
        self.shared = re.compile(f"^{_template(n.layer + n.shared_expert)}("
                                 f"{'|'.join(mod(w) for w in (n.expert_gate, n.expert_up, n.expert_down))})$")
        self.dense = re.compile(f"^{_template(n.layer + n.dense_mlp)}("
                                f"{'|'.join(mod(w) for w in (n.expert_gate, n.expert_up, n.expert_down))})$")
        self.attn_names = ", ".join(w[: -len(".weight")].rsplit(".", 1)[-1]
                                    for w in n.attention_linears())

    def canonical(self, module: str) -> str:
        """The on-disk module name of a name PEFT may use in memory (module_aliases)."""
        for in_memory, on_disk in self.aliases:
            module = module.replace(in_memory, on_disk)
        return module


def check_finite(path: str, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (key `key` of the file `path`) if all its values are finite; else a
    ConversionError naming the key: NaN or Inf factors would make every output of the model
    NaN (a training run that diverged saves such an adapter)."""
    bad = int((~torch.isfinite(tensor)).sum()) if tensor.is_floating_point() else 0
    if bad:
        raise ConversionError(f"{path}: tensor {key!r} holds {bad} NaN or Inf value"
                              f"{'s' if bad > 1 else ''} (of {tensor.numel()}); an adapter with "
                              f"non-finite weights is not imported")
    return tensor


def model_modules(hf: Dict[str, Tuple[int, ...]]):
    """The module names of the HF model (tensor names -> shapes `hf`) that PEFT adapts: those
    with a 2-D weight (the linears and embed_tokens), also under transformers 5's `mlp.` for
    `block_sparse_moe.`."""
    for name, shape in hf.items():
        if name.endswith(".weight") and len(shape) == 2:
            module = name[:-len(".weight")]
            yield module
            if ".block_sparse_moe." in module:
                yield module.replace(".block_sparse_moe.", ".mlp.")


class PeftAdapterFile:
    """`adapter_model.safetensors` of a PEFT LoRA for the model `info`.

    modules: {canonical HF module (mapping names, `block_sparse_moe`): Factor}
    fused: {(layer, "gate_up" | "down"): Factor} (transformers 5 layout; rank is per expert)
    """

    def __init__(self, directory: str, info: ModelInfo, config: PeftLora):
        self.path = _weights_path(directory)
        self.info, self.config = info, config
        self.names = _ModuleNames(info.family)
        self.shapes: Dict[str, Tuple[int, ...]] = {}
        dtypes = {}
        try:
            with safe_open(self.path, framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    self.shapes[key] = tuple(sl.get_shape())
                    dtypes[key] = sl.get_dtype()
        except Exception as exc:
            raise ConversionError(f"{self.path}: not a readable safetensors file (truncated or "
                                  f"corrupt?): {exc}") from None
        kinds = set(dtypes.values())
        if len(kinds) != 1:
            raise ConversionError(f"{self.path}: tensors have mixed dtypes {sorted(kinds)}")
        self.dtype = _DTYPES.get(kinds.pop())
        if self.dtype is None:
            raise ConversionError(f"{self.path}: unsupported dtype {sorted(set(dtypes.values()))}")
        self.modules: Dict[str, Factor] = {}
        self.fused: Dict[Tuple[int, str], Factor] = {}
        self.magnitudes: Dict[str, str] = {}  # DoRA: HF module -> its lora_magnitude_vector key
        self._hf = hf_shapes(info)
        unknown = unmatched_targets(config.target_modules, model_modules(self._hf))
        if unknown:
            raise ConversionError(
                f"{config.path}: target_modules {unknown} match no module of the model "
                f"({info.config_fields()}); a {info.family.base_model_class} has "
                f"{', '.join(info.family.names.peft_order())} (PEFT adapts a module whose name "
                f"equals an entry or ends with '.' + entry)")
        raw: Dict[str, Dict[str, str]] = {}
        self.tokens: Dict[str, str] = {}  # trainable tokens: "embedding"/"output_layer" -> key
        for key in sorted(self.shapes):
            if not key.startswith(_PREFIX):
                raise ConversionError(f"{self.path}: key {key!r} does not start with {_PREFIX!r}")
            name = key[len(_PREFIX):]
            if config.trainable_token_indices and self._token_key(key, name):
                continue
            if name in _SKIPPABLE:
                self._check_base_copy(key, name)
                continue
            if name.endswith(_MAGNITUDE):
                self._add_magnitude(key, name[:-len(_MAGNITUDE)])
                continue
            m = _FACTOR.match(name)
            if not m:
                raise ConversionError(f"{self.path}: key {key!r} is not a LoRA factor (biases "
                                      f"and other PEFT methods do not convert)")
            which = (m.group("lin") or m.group("emb"))[-1]
            raw.setdefault(m.group("module"), {})[which] = key
        for module, keys in raw.items():
            for which in "AB":
                if which not in keys:
                    other = keys["B" if which == "A" else "A"]
                    raise ConversionError(f"{self.path}: key {other!r} has no lora_{which} partner")
            self._add(module, keys["A"], keys["B"])
        if not self.modules and not self.fused:
            raise ConversionError(f"{self.path}: no LoRA factors found")
        for key in sorted(self.shapes):
            check_finite(self.path, key, self.read(key))
        missing = [TOKEN_ROWS[w] for w in TOKEN_ROWS if w not in self.tokens]
        if config.trainable_token_indices and missing:
            raise ConversionError(f"{self.path}: {config.path} has trainable_token_indices but "
                                  f"{_PREFIX}{missing[0]} is missing")
        if self.fused and any(".experts." in m for m in self.modules):
            raise ConversionError(f"{self.path}: mixes per-expert and fused expert LoRA keys")
        if config.use_dora:
            plain = sorted(set(self.modules) - set(self.magnitudes)) + [
                f"fused experts of layer {layer}" for layer, _ in sorted(self.fused)]
            if plain:
                raise ConversionError(
                    f"{self.path}: {config.path} has use_dora=true but {plain[:3]} have no "
                    f"lora_magnitude_vector (DoRA imports for q_proj, k_proj, v_proj, o_proj)")
            orphans = sorted(set(self.magnitudes) - set(self.modules))
            if orphans:
                raise ConversionError(f"{self.path}: {orphans[:3]} have a lora_magnitude_vector "
                                      f"but no LoRA factors")

    def _add_magnitude(self, key: str, module: str) -> None:
        if not self.config.use_dora:
            raise ConversionError(f"{self.path}: key {key!r} is a DoRA magnitude but "
                                  f"{self.config.path} does not set use_dora=true")
        m = self.names.attn.match(module)
        if not m:
            raise ConversionError(f"{self.path}: key {key!r}: DoRA imports for the attention "
                                  f"projections ({self.names.attn_names}) only")
        self._layer(key, m.group(1))
        out = self._hf[module + ".weight"][0]
        if self.shapes[key] != (out,):
            raise self._bad_shape(key, [out])
        self.magnitudes[module] = key

    def _token_key(self, key: str, name: str) -> bool:
        """True for a trainable-token key (rows recorded, PEFT's resized base copies skipped)."""
        h = self.info.shape.hidden_size
        if name in _TOKEN_BASE:  # [V', h], V' the resized vocabulary: the base is not imported
            if len(self.shapes[key]) != 2 or self.shapes[key][1] != h:
                raise self._bad_shape(key, ["V", h])
            return True
        which = next((w for w, n in TOKEN_ROWS.items() if n == name), None)
        if which is None:
            return False
        want = (len(self.config.trainable_token_indices), h)
        if self.shapes[key] != want:
            raise self._bad_shape(key, list(want))
        self.tokens[which] = key
        return True

    def _check_base_copy(self, key: str, name: str) -> None:
        want = self._hf["model.embed_tokens.weight" if "embed" in name else "lm_head.weight"]
        if self.shapes[key] != want:
            raise ConversionError(f"{self.path}: key {key!r} has shape {list(self.shapes[key])}, the "
                                  f"model's is {list(want)} (resized vocabulary is not supported)")

    def _bad_shape(self, key: str, want) -> ConversionError:
        return ConversionError(
            f"{self.path}: key {key!r} has shape {list(self.shapes[key])}, but the model "
            f"({self.info.config_fields()}) implies {want}")

    def _layer(self, key: str, layer: str, expert: str = None) -> int:
        s = self.info.shape
        if int(layer) >= s.num_layers or (expert is not None and int(expert) >= s.num_experts):
            raise ConversionError(f"{self.path}: key {key!r} names a layer or expert the model "
                                  f"({self.info.config_fields()}) does not have")
        return int(layer)

    def _add(self, module: str, a_key: str, b_key: str) -> None:
        a, b = self.shapes[a_key], self.shapes[b_key]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise ConversionError(f"{self.path}: keys {a_key!r} {list(a)} and {b_key!r} {list(b)} "
                                  f"are not a LoRA pair [r, in], [out, r]")
        fm = _FUSED.match(module)
        if fm:
            return self._add_fused(int(self._layer(a_key, fm.group(1))), a_key, b_key)
        names, mn = (module, ), self.names
        on_disk = mn.canonical(module)
        if (m := mn.attn.match(module)):
            self._layer(a_key, m.group(1))
            canonical = module
        elif (m := mn.experts.match(on_disk)):
            self._layer(a_key, m.group(1), m.group(2))
            canonical = mn.expert.format(l=m.group(1), e=m.group(2)) + m.group(3)
        elif (m := mn.shared.match(module)) or (m := mn.dense.match(module)):
            self._layer(a_key, m.group(1))  # a shared expert, a dense layer's MLP: linears
            canonical = module
        elif (m := mn.gate.match(on_disk)):
            self._layer(a_key, m.group(1))
            canonical = mn.router.format(l=m.group(1))[: -len(".weight")]
            names = (module, module + ".weight")
        elif module in ("model.embed_tokens", "lm_head"):
            canonical = module
        else:
            raise ConversionError(f"{self.path}: key {a_key!r}: module {module!r} is not a "
                                  f"{self.info.family.base_model_class} module this importer knows")
        if canonical + ".weight" not in self._hf:  # e.g. a dense MLP on an MoE layer
            raise ConversionError(f"{self.path}: key {a_key!r}: module {module!r} is not part of "
                                  f"the model as config.json describes it "
                                  f"({self.info.config_fields()})")
        out, inp = self._hf[canonical + ".weight"]
        if module == "model.embed_tokens":  # A [r, V], B [h, r]
            out, inp = inp, out
            if "lora_embedding" not in a_key:
                raise ConversionError(f"{self.path}: key {a_key!r}: embed_tokens factors are "
                                      f"named lora_embedding_A / lora_embedding_B")
        if a[1] != inp:
            raise self._bad_shape(a_key, [a[0], inp])
        if b[0] != out:
            raise self._bad_shape(b_key, [out, b[1]])
        if canonical in self.modules:
            raise ConversionError(f"{self.path}: key {a_key!r}: module {canonical} appears twice")
        self.modules[canonical] = self._factor(a_key, b_key, a[0], names, a_key)

    def _add_fused(self, layer: int, a_key: str, b_key: str) -> None:
        s = self.info.shape
        E, h, f = s.num_experts, s.hidden_size, s.ffn_hidden_size
        a, b = self.shapes[a_key], self.shapes[b_key]
        if a[1] == h and b[0] == 2 * f:
            which, param = "gate_up", "gate_up_proj"
        elif a[1] == f and b[0] == h:
            which, param = "down", "down_proj"
        else:
            raise ConversionError(
                f"{self.path}: key {a_key!r} {list(a)} / {b_key!r} {list(b)} fit neither "
                f"gate_up_proj (A [E*r, {h}], B [{2 * f}, E*r]) nor down_proj (A [E*r, {f}], "
                f"B [{h}, E*r]) of the model ({self.info.config_fields()})")
        if a[0] % E:
            raise ConversionError(f"{self.path}: key {a_key!r} has {a[0]} rows, not a multiple "
                                  f"of the {E} experts")
        if (layer, which) in self.fused:
            raise ConversionError(f"{self.path}: key {a_key!r}: {param} of layer {layer} appears twice")
        names = (f"model.layers.{layer}.mlp.experts.{param}", f"model.layers.{layer}.mlp.experts")
        self.fused[(layer, which)] = self._factor(a_key, b_key, a[0] // E, names, a_key)

    def _factor(self, a_key, b_key, rank, names, where) -> Factor:
        cfg_rank, alpha = self.config.rank_alpha(*names)
        if cfg_rank != rank:
            raise ConversionError(
                f"{self.path}: key {where!r} has rank {rank}, but {self.config.path} gives "
                f"{names[0]} rank {cfg_rank} (r / rank_pattern)")
        return Factor(a_key, b_key, rank, scale(rank, alpha, self.config.use_rslora), alpha)

    def read(self, key: str) -> torch.Tensor:
        try:
            with safe_open(self.path, framework="pt") as f:
                return f.get_tensor(key)
        except Exception as exc:
            raise ConversionError(f"{self.path}: cannot read tensor {key!r}: {exc}") from None
