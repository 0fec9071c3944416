"""PEFT's `adapter_config.json` for LoRA: read (validated), write, and PEFT's scaling rules.

PEFT scales an adapter's update B A by alpha / r (alpha / sqrt(r) with `use_rslora`), where r and
alpha come from `rank_pattern` / `alpha_pattern` when a key matches the module name, tried in
dict order with `re.match(rf"(.*\\.)?({key})$", name)`, else from `r` / `lora_alpha`.

Plain LoRA, DoRA (attention) and trainable tokens in the form `export peft` writes
(`trainable_token_indices: {"embed_tokens": ids, "lm_head": the same ids}`) convert; LoRA biases,
`fan_in_fan_out`, `modules_to_save`, other trainable-token forms and non-LoRA PEFT types raise
ConversionError naming adapter_config.json and the field.

Prefix tuning (`peft_type: PREFIX_TUNING`, task CAUSAL_LM): read as PeftPrefix (the sizes checked
against the model by the import), written by `prefix_config_dict` with the fields PEFT saves.
PEFT's GQA rule: token_dim = num_key_value_heads * head_dim, num_attention_heads =
num_key_value_heads. Other prompt-learning types (PROMPT_TUNING, P_TUNING, ...) are refused.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

from megatron_lora.convert.errors import ConversionError
from megatron_lora.families import FAMILIES
from megatron_lora.jsonfile import json_value, read_json, short

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


@dataclass(frozen=True)
class PeftLora:
    """The fields of a PEFT LoRA config this package uses."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: Tuple[str, ...] = ()
    target_parameters: Tuple[str, ...] = ()
    rank_pattern: Dict[str, int] = field(default_factory=dict)
    alpha_pattern: Dict[str, float] = field(default_factory=dict)
    path: str = CONFIG_NAME
    use_dora: bool = False
    trainable_token_indices: Tuple[int, ...] = ()

    def rank_alpha(self, *names: str) -> Tuple[int, float]:
        """(r, alpha) PEFT gives the first of `names` a pattern matches (else the defaults).

        Several names: the same module under the naming of transformers 4 and 5."""
        return (_lookup(self.rank_pattern, names, self.r),
                float(_lookup(self.alpha_pattern, names, self.lora_alpha)))



def _bool_field(cfg: dict, name: str, path: str) -> bool:
    """cfg[name] (false when absent); ConversionError naming the file and field otherwise."""
    value = cfg.get(name, False)
    if not isinstance(value, bool):
        raise ConversionError(f"{path}: field {name} must be true or false, got "
                              f"{json_value(value)}")
    return value

def _lookup(patterns: Dict[str, float], names, default):
    for key, value in patterns.items():
        for name in names:
            if re.match(rf"(.*\.)?({key})$", name):
                return value
    return default


def scale(r: int, alpha: float, use_rslora: bool) -> float:
    """The factor PEFT (and megatron_lora) multiply B A by."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def alpha_for(target_scale: float, r: int, use_rslora: bool) -> float:
    """An alpha with scale(r, alpha) == target_scale, so a change of rank (stacking, zero
    padding) keeps the scale: exact in Python floats when one of the doubles around
    target_scale * r (or * sqrt(r)) gives it, else the closest (a relative error of about 1e-16,
    far below the fp32/bf16 resolution the update is computed in)."""
    alpha = target_scale * (math.sqrt(r) if use_rslora else r)
    best = alpha
    for direction in (math.inf, -math.inf):
        a = alpha
        for _ in range(16):
            got = scale(r, a, use_rslora)
            if got == target_scale:
                return a
            if abs(got - target_scale) < abs(scale(r, best, use_rslora) - target_scale):
                best = a
            a = math.nextafter(a, direction)
    return best


def _finite(x) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float range
        return False


def _require(cfg: dict, path: str, name: str):
    if name not in cfg:
        raise ConversionError(f"{path}: required field {name!r} is missing")
    return cfg[name]


@dataclass(frozen=True)
class PeftPrefix:
    """The fields of a PEFT PREFIX_TUNING config (CAUSAL_LM, one transformer submodule).
    The saved table `prompt_embeddings` is [num_virtual_tokens, num_layers * 2 * token_dim]."""

    num_virtual_tokens: int
    token_dim: int
    num_attention_heads: int
    num_layers: int
    prefix_projection: bool = False
    encoder_hidden_size: Optional[int] = None
    path: str = CONFIG_NAME


# PEFT's prompt-learning types other than prefix tuning: virtual token embeddings, not keys and
# values, which megatron_lora does not train.
_PROMPT_TYPES = ("PROMPT_TUNING", "P_TUNING", "MULTITASK_PROMPT_TUNING", "ADAPTION_PROMPT",
                 "CPT", "CARTRIDGE")


def _read_prefix(cfg: dict, path: str) -> PeftPrefix:
    task = cfg.get("task_type")
    if task != "CAUSAL_LM":
        raise ConversionError(f"{path}: field task_type={short(task)}: prefix tuning imports "
                              f"for 'CAUSAL_LM' (a Mixtral decoder)")
    sizes = {}
    for name in ("num_virtual_tokens", "token_dim", "num_attention_heads", "num_layers"):
        value = _require(cfg, path, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConversionError(f"{path}: field {name} must be a positive integer, got "
                                  f"{json_value(value)}")
        sizes[name] = value
    sub = cfg.get("num_transformer_submodules", 1)
    if sub not in (None, 1) or isinstance(sub, bool):
        raise ConversionError(f"{path}: field num_transformer_submodules={short(sub)}: a "
                              f"decoder-only model has 1 (2 is for encoder-decoder models)")
    projection = _bool_field(cfg, "prefix_projection", path)
    hidden = cfg.get("encoder_hidden_size")
    if hidden is not None and (isinstance(hidden, bool) or not isinstance(hidden, int)
                               or hidden < 1):
        raise ConversionError(f"{path}: field encoder_hidden_size must be a positive integer or "
                              f"null, got {json_value(hidden)}")
    if cfg.get("modules_to_save"):
        raise ConversionError(f"{path}: field modules_to_save={short(cfg['modules_to_save'])}: "
                              f"fully trained modules are not supported")
    _check_auto_mapping(cfg, path)
    return PeftPrefix(prefix_projection=projection, encoder_hidden_size=hidden, path=path,
                      **sizes)


def _check_auto_mapping(cfg: dict, path: str) -> None:
    auto = cfg.get("auto_mapping") or {}
    base_class = auto.get("base_model_class") if isinstance(auto, dict) else None
    known = [a for fam in FAMILIES for a in fam.architectures]
    if base_class is not None and base_class not in known:
        raise ConversionError(f"{path}: adapter for {short(base_class)}, not a model of a "
                              f"supported family ({', '.join(known)})")


def read_adapter_config(directory: str) -> Union[PeftLora, PeftPrefix]:
    """Read and validate `directory/adapter_config.json` (a LoRA, or a prefix tuning, for a
    Mixtral model)."""
    from megatron_lora.runtime.folder_files import folder_file

    path = folder_file(directory, CONFIG_NAME, ConversionError)  # no symlink out of the folder
    cfg = read_json(path, ConversionError, what="not a PEFT adapter folder")
    if not isinstance(cfg, dict):
        raise ConversionError(f"{path}: expected a JSON object, got {json_value(cfg)}")
    peft_type = _require(cfg, path, "peft_type")
    if peft_type == "PREFIX_TUNING":
        return _read_prefix(cfg, path)
    if peft_type in _PROMPT_TYPES:
        raise ConversionError(f"{path}: peft_type={short(peft_type)} (learned input embeddings) "
                              f"does not convert; of PEFT's prompt-learning methods only "
                              f"'PREFIX_TUNING' does")
    if peft_type != "LORA":
        raise ConversionError(f"{path}: peft_type={short(peft_type)}; only 'LORA' and "
                              f"'PREFIX_TUNING' adapters convert")
    unsupported = [
        ("lora_bias", lambda v: bool(v), "LoRA biases (lora_bias=true) are not supported"),
        ("bias", lambda v: v not in (None, "none"), "trained biases (bias != 'none') are not supported"),
        ("fan_in_fan_out", lambda v: bool(v), "fan_in_fan_out=true is not supported"),
        ("modules_to_save", lambda v: bool(v), "modules_to_save (fully trained modules) is not supported"),
        ("layer_replication", lambda v: bool(v), "layer_replication is not supported"),
    ]
    for name, bad, why in unsupported:
        if name in cfg and bad(cfg[name]):
            raise ConversionError(f"{path}: field {name}={short(cfg[name])}: {why}")
    _check_auto_mapping(cfg, path)
    r = _require(cfg, path, "r")
    alpha = _require(cfg, path, "lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ConversionError(f"{path}: field r must be a positive integer, got {json_value(r)}")
    if (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0
            or not _finite(alpha)):
        raise ConversionError(f"{path}: field lora_alpha must be a positive number, got "
                              f"{json_value(alpha)}")
    if "target_modules" not in cfg and "target_parameters" not in cfg:
        raise ConversionError(f"{path}: required field 'target_modules' is missing")
    modules = cfg.get("target_modules") or []
    if isinstance(modules, str):
        raise ConversionError(f"{path}: target_modules={short(modules)} is a regular expression; "
                              f"list the module names (q_proj, ..., w1, w2, w3, gate)")
    params = cfg.get("target_parameters") or []
    for name, value in (("target_modules", modules), ("target_parameters", params)):
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConversionError(f"{path}: field {name} must be a list of module names, got "
                                  f"{json_value(value)}")
    patterns = {}
    for name, kind in (("rank_pattern", "a positive integer"), ("alpha_pattern", "a number")):
        value = cfg.get(name) or {}
        if not isinstance(value, dict):
            raise ConversionError(f"{path}: field {name} must be an object, got "
                                  f"{json_value(value)}")
        for key, v in value.items():
            ok = isinstance(v, int) and v >= 1 if name == "rank_pattern" else (
                isinstance(v, (int, float)) and _finite(v) and v > 0)
            if isinstance(v, bool) or not ok:
                raise ConversionError(f"{path}: field {name}[{json.dumps(key[:60])}] must be "
                                      f"{kind}, got {json_value(v)}")
        patterns[name] = dict(value)
    use_rslora = _bool_field(cfg, "use_rslora", path)
    use_dora = _bool_field(cfg, "use_dora", path)
    tokens = _token_indices(cfg.get("trainable_token_indices"), path)
    return PeftLora(r=r, lora_alpha=float(alpha), use_rslora=use_rslora, use_dora=use_dora,
                    trainable_token_indices=tokens,
                    target_modules=tuple(modules), target_parameters=tuple(params),
                    rank_pattern=patterns["rank_pattern"], alpha_pattern=patterns["alpha_pattern"],
                    path=path)


def unmatched_targets(targets, module_names) -> List[str]:
    """The entries of a target_modules list that match none of `module_names`, by PEFT's rule
    for a list: a module is targeted when its name equals an entry or ends with "." + entry.
    (A string would be a regular expression full-matched against the names; read_adapter_config
    refuses strings.)"""
    names = list(module_names)
    return [t for t in targets
            if not any(n == t or n.endswith("." + t) for n in names)]


def _token_indices(value, path: str) -> Tuple[int, ...]:
    """trainable_token_indices as our trainable tokens: the same distinct ids for embed_tokens and
    lm_head (both rows trained, what `export peft` writes), else ConversionError."""
    if not value:
        return ()
    form = ('trainable_token_indices must be {"embed_tokens": [ids], "lm_head": [the same ids]} '
            '(both rows trained, as megatron-lora trains new tokens)')
    if not isinstance(value, dict) or set(value) != {"embed_tokens", "lm_head"}:
        raise ConversionError(f"{path}: field trainable_token_indices={short(value)}: {form}")
    ids = value["embed_tokens"]
    if (value["lm_head"] != ids or not isinstance(ids, list) or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
            or len(set(ids)) != len(ids)):
        raise ConversionError(f"{path}: field trainable_token_indices={short(value)}: {form}, "
                              f"distinct non-negative ints")
    return tuple(ids)


# parameter_modules: module names (PEFT's short names) that transformers 5 keeps as bare
# parameters rather than nn.Linear: the fused experts (Mixtral's w1/w3 -> gate_up_proj [E, 2f, h], w2 -> down_proj [E, h, f]) and
# the router's weight. PEFT adapts them with lora.ParamWrapper, which refuses lora_dropout != 0
# (it cannot apply dropout to the input of a parameter), so PeftModel.from_pretrained fails on an
# adapter_config.json that targets them with dropout.
def inference_dropout(lora_dropout: float, target_modules: List[str],
                      parameter_modules: Tuple[str, ...]) -> Tuple[float, List[str]]:
    """(lora_dropout for adapter_config.json, notes saying what was changed and why).

    Dropout is a training-time setting: PEFT applies it only in train mode, so inference (and
    merging) computes the same update with any value. 0 where PEFT's ParamWrapper requires it
    (parameter_modules targeted: the family's HFNames.parameter_modules), else the trained value."""
    wrapped = list(dict.fromkeys(m for m in target_modules if m in parameter_modules))
    if not lora_dropout or not wrapped:
        return lora_dropout, []
    return 0.0, [
        f"lora_dropout={lora_dropout} (the training setting) written as 0 in {CONFIG_NAME}: "
        f"transformers 5 keeps {', '.join(wrapped)} as fused parameters, and PEFT's "
        f"lora.ParamWrapper, which adapts them, refuses lora_dropout != 0. Dropout acts only in "
        f"training, so inference and merged weights are unchanged; set lora_dropout again to "
        f"train further with PEFT on transformers 4's per-expert modules"]


def adapter_config_dict(*, r: int, lora_alpha: float, use_rslora: bool, target_modules: List[str],
                        rank_pattern: Dict[str, int], alpha_pattern: Dict[str, float],
                        lora_dropout: float = 0.0, base_model: Optional[str] = None,
                        use_dora: bool = False, trainable_token_indices=None,
                        family, target_parameters=()) -> dict:
    """A complete PEFT LoRA adapter_config.json for a per-expert adapter of a `family` model.

    trainable_token_indices: PEFT's {module name: [token ids]} (embed_tokens, lm_head), or None.
    target_parameters: PEFT's parameter targets (export/peft_fused.py), written only when given."""
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "auto_mapping": {"base_model_class": family.base_model_class,
                         "parent_library": family.transformers_module},
        "base_model_name_or_path": base_model,
        "r": r,
        "lora_alpha": lora_alpha,
        "use_rslora": use_rslora,
        "target_modules": list(target_modules),
        "rank_pattern": dict(rank_pattern),
        "alpha_pattern": dict(alpha_pattern),
        "lora_dropout": lora_dropout,
        "bias": "none",
        "lora_bias": False,
        "use_dora": bool(use_dora),
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "trainable_token_indices": (None if not trainable_token_indices else
                                    {k: list(v) for k, v in trainable_token_indices.items()}),
        "layers_to_transform": None,
        "layers_pattern": None,
    }
    if target_parameters:
        config["target_parameters"] = list(target_parameters)
    return config


def prefix_config_dict(*, num_virtual_tokens: int, token_dim: int, num_attention_heads: int,
                       num_layers: int, encoder_hidden_size: int, prefix_projection: bool,
                       base_model: Optional[str] = None) -> dict:
    """A PEFT PREFIX_TUNING adapter_config.json with the fields PEFT saves for a causal LM
    (peft_version is left out: PEFT fills in its own when loading)."""
    return {
        "auto_mapping": None,
        "base_model_name_or_path": base_model,
        "encoder_hidden_size": encoder_hidden_size,
        "inference_mode": True,
        "init_weights": None,
        "modules_to_save": None,
        "num_attention_heads": num_attention_heads,
        "num_layers": num_layers,
        "num_transformer_submodules": 1,
        "num_virtual_tokens": num_virtual_tokens,
        "peft_type": "PREFIX_TUNING",
        "prefix_projection": prefix_projection,
        "revision": None,
        "task_type": "CAUSAL_LM",
        "token_dim": token_dim,
    }
