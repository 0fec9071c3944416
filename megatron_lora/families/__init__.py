"""Model families as data, and the one entry point that reads a Hugging Face config.json.

`read_hf_config(path)` detects the family from config.json (`architectures`, then `model_type`)
and returns its `ModelInfo`; a config of no supported family is refused before any work, listing
the supported ones. Adding a family: one module here defining a `Family`, listed in FAMILIES.
"""

from __future__ import annotations

import os
from typing import Tuple

from megatron_lora.families.family import Family, HFNames, ModelInfo
from megatron_lora.families.fields import Fields, ModelConfigError
from megatron_lora.families.deepseek_v3 import DEEPSEEK_V2, DEEPSEEK_V3
from megatron_lora.families.glm4_moe import GLM4_MOE
from megatron_lora.families.gpt_oss import GPT_OSS
from megatron_lora.families.mixtral import MIXTRAL
from megatron_lora.families.olmoe import OLMOE
from megatron_lora.families.qwen2_moe import QWEN2_MOE
from megatron_lora.families.qwen3_moe import QWEN3_MOE
from megatron_lora.families.shape import (VOCAB_MULTIPLE, ModelShape, padded_vocab_size,
                                          tiny_moe_shape)
from megatron_lora.jsonfile import json_value, read_json
from megatron_lora.runtime.folder_files import folder_file

FAMILIES: Tuple[Family, ...] = (MIXTRAL, QWEN3_MOE, QWEN2_MOE, OLMOE, GPT_OSS, GLM4_MOE,
                                DEEPSEEK_V3, DEEPSEEK_V2)

__all__ = ["FAMILIES", "Family", "HFNames", "ModelInfo", "ModelConfigError", "ModelShape",
           "VOCAB_MULTIPLE", "family_of", "model_info", "padded_vocab_size", "read_hf_config",
           "tiny_moe_shape"]


def supported() -> str:
    return ", ".join(f"{fam.name} ({'/'.join(fam.architectures)})" for fam in FAMILIES)


def family_of(cfg: dict, source: str = "config.json") -> Family:
    """The family `cfg` belongs to: by `architectures`, else by `model_type`."""
    f = Fields(cfg, source)
    archs = f.get("architectures", list, default=[], nullable=True) or []
    if not all(isinstance(a, str) for a in archs):
        raise f.bad("architectures", "must be a list of strings", archs)
    model_type = f.get("model_type", str, default=None, nullable=True)
    for fam in FAMILIES:
        if set(archs) & set(fam.architectures):
            return fam
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    raise ModelConfigError(f"{source}: architectures={archs} (model_type={model_type!r}) is not "
                           f"a supported model family; supported: {supported()}")


def model_info(cfg: dict, source: str = "config.json") -> ModelInfo:
    """Validate a config.json dict and describe its model; ModelConfigError names the field."""
    family = family_of(cfg, source)
    fields = Fields(cfg, source, defaults=family.hf_defaults)
    shape, vocab, dtype = family.read(fields, cfg)
    defaulted = tuple((k, v) for k, v in fields.defaulted.items()  # the numbers: sizes, scales
                      if isinstance(v, (int, float)) and not isinstance(v, bool))
    return ModelInfo(family=family, shape=shape, vocab_size=vocab, dtype=dtype,
                     hf_config=dict(cfg), defaulted=defaulted)


def read_hf_config(path: str) -> ModelInfo:
    """ModelInfo from a config.json file (or a directory holding one)."""
    if os.path.isdir(path):  # a model folder's config.json must resolve inside the folder
        path = folder_file(path, "config.json", ModelConfigError)
    cfg = read_json(path, ModelConfigError)
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"{path}: expected a JSON object, got {json_value(cfg)}")
    return model_info(cfg, source=path)
