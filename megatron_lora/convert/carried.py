"""Tensors a checkpoint holds that the model does not build, carried through conversion unchanged.

A family's `extra_layers_field` counts layers stored after the `num_hidden_layers` decoder layers
(GLM-4.5's multi-token-prediction layers, `num_nextn_predict_layers`): `model.layers.{L}...` ..
`model.layers.{L + n - 1}...`. hf-to-mcore neither builds nor trains them; it copies their
tensors, each in its own dtype and bit for bit, into `hf_carried.safetensors` inside the megatron
checkpoint folder, and mcore-to-hf (so also `export hf --merge`) copies that file back into the
HF folder as `model-carried.safetensors`, listed in the index: the result is the complete
checkpoint again. The file is read only from inside its folder (no symlink out), and only tensors
of the layers config.json counts are taken (ConversionError naming the file and tensor otherwise).
The tensors are read through the checkpoint's reader, so a fine-grained FP8 checkpoint's
(DeepSeek-V3's MTP layer) are carried dequantised, in the dtype of its other weights, like the
rest of the output, whose config.json has no FP8 quantization_config
(tests/families/test_deepseek_v3.py).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from typing import Dict, List

from safetensors import safe_open

from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.safetensors_write import StreamingSafetensorsWriter
from megatron_lora.runtime.folder_files import folder_file

CARRIED = "hf_carried.safetensors"  # in the megatron checkpoint folder
HF_CARRIED = "model-carried.safetensors"  # in the HF folder mcore-to-hf writes


def _prefixes(info) -> tuple:
    """`model.layers.{l}.` of each layer the family's extra_layers_field counts ((): none)."""
    field = info.family.extra_layers_field
    # absent: transformers' default (families/hf_defaults.py: one MTP layer for DeepSeek-V3)
    count = info.hf_config.get(field, info.family.hf_defaults.get(field, 0)) if field else 0
    L = info.shape.num_layers
    return tuple(info.family.names.layer.format(l=l) for l in range(L, L + (count or 0)))


def unbuilt_tensors(hf_dir: str, info, ckpt, say: bool = True) -> List[str]:
    """Names of `ckpt`'s tensors in the layers after the decoder that the family does not build
    (sorted); said once on stderr when `say`."""
    prefixes = _prefixes(info)
    names = sorted(n for n in ckpt.tensors if prefixes and n.startswith(prefixes))
    if names and say:
        field = info.family.extra_layers_field
        L = info.shape.num_layers
        print(f"{hf_dir}: skipping the {len(names)} tensors of layer(s) {L}..{L + len(prefixes) - 1}"
              f" ({field}={len(prefixes)}): they are not built nor trained", file=sys.stderr)
    return names


def write_carried(directory: str, ckpt, names: List[str]) -> None:
    """`directory/hf_carried.safetensors` with the HF tensors `names`, one at a time, each in its
    file's dtype (nothing written when `names` is empty)."""
    if not names:
        return
    entries = [(n, ckpt.tensors[n].shape, ckpt.tensors[n].dtype) for n in names]
    with StreamingSafetensorsWriter(os.path.join(directory, CARRIED), entries) as w:
        for name in names:
            w.write(name, ckpt.read(name).contiguous())


def read_carried(mcore_dir: str, info) -> Dict[str, int]:
    """{tensor name: bytes} of the checkpoint's carried file ({} when it has none), checked: the
    file lies inside the folder, its header is readable, and every tensor belongs to a layer the
    config's extra_layers_field counts. Reads no tensor data."""
    path = folder_file(mcore_dir, CARRIED, ConversionError)
    if not os.path.lexists(path):
        if _prefixes(info):
            field = info.family.extra_layers_field
            print(f"{mcore_dir}: no {CARRIED}: the output holds no tensors of the "
                  f"{field}={info.hf_config.get(field)} layers after the decoder (the HF model "
                  f"had none, or was converted before they were kept)", file=sys.stderr)
        return {}
    try:
        with safe_open(path, framework="pt") as f:
            shapes = {n: (f.get_slice(n).get_shape(), f.get_slice(n).get_dtype())
                      for n in f.keys()}
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise ConversionError(f"{path}: not a readable safetensors file: {exc}") from None
    prefixes = _prefixes(info)
    for name in sorted(shapes):
        if not (prefixes and name.startswith(prefixes)):
            field = info.family.extra_layers_field or "extra_layers_field"
            raise ConversionError(
                f"{path}: tensor {name!r} is not in a layer config.json counts after the decoder "
                f"({field}={info.hf_config.get(field, 0)}); convert the HF model again")
    return {n: _bytes(shape, dtype) for n, (shape, dtype) in shapes.items()}


def _bytes(shape, dtype: str) -> int:
    size = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "U8": 1, "I8": 1,
            "F8_E4M3": 1, "F8_E5M2": 1}.get(dtype)
    if size is None:
        raise ConversionError(f"unsupported safetensors dtype {dtype} in {CARRIED}")
    return math.prod(shape) * size


def copy_carried(mcore_dir: str, out_dir: str, carried: Dict[str, int],
                 weight_map: Dict[str, str]) -> int:
    """Copy the carried file (bytes unchanged) into `out_dir` as model-carried.safetensors and
    list its tensors in `weight_map`; returns its tensors' bytes (for the index's total_size)."""
    if not carried:
        return 0
    clash = sorted(set(carried) & set(weight_map))
    if clash:
        raise ConversionError(f"{os.path.join(mcore_dir, CARRIED)}: tensor {clash[0]!r} is also "
                              f"a tensor of the model")
    shutil.copyfile(os.path.join(mcore_dir, CARRIED), os.path.join(out_dir, HF_CARRIED))
    weight_map.update({n: HF_CARRIED for n in carried})
    return sum(carried.values())
