"""HF safetensors (any supported family) -> megatron-core torch_dist checkpoint, streamed.

    hf_to_mcore("Mixtral-8x7B", "mixtral-mcore")

Everything that can be wrong with the input is checked before the output directory is created
(`open_hf`): config.json, index, shard files and headers, every tensor's presence, shape and dtype
against config.json. Then each megatron chunk is read from its HF tensor(s), written and dropped;
fine-grained FP8 tensors are dequantised as they are read (convert/fp8.py).
The output directory appears (by rename) only when complete. Besides the torch_dist files it holds
`hf_config.json` (the source config.json, less a quantization_config whose weights were
dequantised: FP8, MXFP4), `megatron_lora.json` (vocabulary sizes, dtype), the tokenizer/generation
files of the source under `hf_files/`, and the tensors of layers the model does not build
(multi-token prediction) in `hf_carried.safetensors` (convert/carried.py), so mcore-to-hf can
rebuild a complete HF directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from typing import Tuple

import torch

from megatron_lora.convert import fp8
from megatron_lora.convert.atomic import atomic_directory
from megatron_lora.convert.carried import unbuilt_tensors, write_carried
from megatron_lora.convert.dcp_write import write_torch_dist
from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.hf_files import HFCheckpoint
from megatron_lora.convert.hf_precheck import check_counts, check_json_files
from megatron_lora.convert.mapping import (
    IGNORED_HF_SUFFIXES,
    OWN_DTYPE_SUFFIXES,
    extra_states,
    hf_shapes,
    mcore_tensors,
)
from megatron_lora.convert.outputs import prepare_output_dir
from megatron_lora.convert.progress import byte_bar
from megatron_lora.families import ModelInfo, read_hf_config
from megatron_lora.runtime.folder_files import folder_file

SIDECAR = "megatron_lora.json"
HF_CONFIG = "hf_config.json"
HF_FILES = "hf_files"
_PASSTHROUGH = ("generation_config.json", "special_tokens_map.json", "added_tokens.json",
                "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "chat_template.jinja")


def open_hf(hf_dir: str) -> Tuple[ModelInfo, HFCheckpoint, torch.dtype]:
    """Read and check an HF model directory: (model info, safetensors reader, weights dtype).

    A fine-grained FP8 checkpoint (quantization_config quant_method 'fp8') gives a reader whose
    FP8 tensors read dequantised in the dtype of its other weights (convert/fp8.py).
    Raises ConversionError / ModelConfigError naming the file, tensor or config field."""
    info = read_hf_config(hf_dir)
    ckpt = HFCheckpoint(hf_dir)
    for name in _PASSTHROUGH:  # copied by hf_to_mcore: only from inside the folder
        folder_file(hf_dir, name, ConversionError)
    config = os.path.join(hf_dir, "config.json")
    block_fp8 = fp8.read_format(info.hf_config, config)
    quantized = fp8.quantized_weights(ckpt, block_fp8, config)
    check_counts(hf_dir, info, ckpt.tensors)  # before the table, which grows with them
    expected = hf_shapes(info)
    packed = _mxfp4_pairs(hf_dir, ckpt, expected) if info.family.fused_experts else set()
    for name, shape in expected.items():
        got = ckpt.tensors.get(name)
        if got is None and name in packed:
            continue
        if got is None:
            raise ConversionError(f"{hf_dir}: tensor {name!r} is missing from the checkpoint"
                                  f"{info.defaults_note()}")
        if got.shape != shape:
            raise ConversionError(
                f"{os.path.join(hf_dir, got.file)}: tensor {name!r} has shape {list(got.shape)}, "
                f"but config.json ({info.config_fields()}) implies {list(shape)}"
                f"{info.defaults_note()}"
            )
    ignored = IGNORED_HF_SUFFIXES + (("lm_head.weight",) if info.shape.tie_embeddings else ())
    pair_names = {f"{n}_{part}" for n in packed for part in ("blocks", "scales")}
    pair_names |= set(quantized.values())
    skipped = set(unbuilt_tensors(hf_dir, info, ckpt, say=_first_rank()))
    extra = sorted(n for n in ckpt.tensors if n not in expected and not n.endswith(ignored)
                   and n not in pair_names and n not in skipped)
    if extra:
        raise ConversionError(
            f"{hf_dir}: tensors not part of the model as config.json describes it: "
            f"{extra[:5]}{' ...' if len(extra) > 5 else ''}"
        )
    dtypes = {ckpt.tensors[n].dtype for n in expected if n not in packed
              and n not in quantized and not n.endswith(OWN_DTYPE_SUFFIXES)}
    if len(dtypes) > 1 or (not dtypes and not quantized):
        raise ConversionError(f"{hf_dir}: tensors have mixed dtypes {sorted(map(str, dtypes))}")
    dtype = dtypes.pop() if dtypes else torch.bfloat16  # all FP8: transformers' default
    if quantized:
        ckpt = fp8.FP8Checkpoint(ckpt, quantized, block_fp8.block, dtype)
    return info, ckpt, dtype


def _own_dtype(t, ckpt: HFCheckpoint):
    """`t` stored in its HF tensor's dtype when that tensor keeps its own (OWN_DTYPE_SUFFIXES),
    so that the round trip gives it back bit for bit."""
    names = [n for c in t.chunks for n in c.source.hf_shapes()]
    if names and all(n.endswith(OWN_DTYPE_SUFFIXES) for n in names):
        return dataclasses.replace(t, dtype=ckpt.tensors[names[0]].dtype)
    return t


def _first_rank() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _mxfp4_pairs(hf_dir: str, ckpt: HFCheckpoint, expected: dict) -> set:
    """The expected expert weights stored as MXFP4 `_blocks` / `_scales` pairs (checked against
    the dense [E, in, out] shape config.json implies: blocks [E, out, in / 32, 16])."""
    from megatron_lora.convert import mxfp4

    packed = set()
    for name, shape in expected.items():
        blocks, scales = ckpt.tensors.get(f"{name}_blocks"), ckpt.tensors.get(f"{name}_scales")
        if name in ckpt.tensors or (blocks is None and scales is None):
            continue
        if blocks is None or scales is None:
            raise ConversionError(f"{hf_dir}: tensor {name!r} is stored as MXFP4 but "
                                  f"{name}_{'blocks' if blocks is None else 'scales'} is missing")
        where = os.path.join(hf_dir, blocks.file)
        mxfp4.check_pair(name, blocks.shape, scales.shape, blocks.dtype, scales.dtype, where)
        want = (shape[0], shape[2], shape[1] // 32, mxfp4.BLOCK_BYTES)
        if len(shape) != 3 or shape[1] % 32 or tuple(blocks.shape) != want:
            raise ConversionError(
                f"{where}: tensor {name + '_blocks'!r} has shape {list(blocks.shape)}, but "
                f"config.json implies {list(want)} (MXFP4 of the dense {list(shape)})")
        packed.add(name)
    return packed


def hf_to_mcore(hf_dir: str, save: str, *, overwrite: bool = False, progress: bool = True) -> None:
    """Convert `hf_dir` into a torch_dist checkpoint at `save` (created atomically)."""
    prepare_output_dir(save, overwrite=overwrite, inputs={"--hf-dir": hf_dir})
    info, ckpt, dtype = open_hf(hf_dir)
    check_json_files(hf_dir, _PASSTHROUGH)  # before anything is written
    tensors = [_own_dtype(t, ckpt) for t in mcore_tensors(info, dtype)]
    total = sum(sum(_nbytes(c.sizes, t.dtype or dtype) for c in t.chunks) for t in tensors)
    with atomic_directory(save, overwrite) as tmp, byte_bar(total, "hf-to-mcore", progress) as bar:

        def chunk_data(t, c):
            data = c.source.read(ckpt, tuple(slice(0, n) for n in c.source.shape))
            bar.update(data.nbytes)
            return data.reshape(c.sizes)

        write_torch_dist(tmp, tensors, extra_states(info), chunk_data, dtype)
        write_sidecar(tmp, info, dtype)
        write_carried(tmp, ckpt, unbuilt_tensors(hf_dir, info, ckpt, say=False))
        os.makedirs(os.path.join(tmp, HF_FILES))
        for name in _PASSTHROUGH:
            if os.path.isfile(os.path.join(hf_dir, name)):
                shutil.copyfile(os.path.join(hf_dir, name), os.path.join(tmp, HF_FILES, name))


def write_sidecar(directory: str, info: ModelInfo, dtype: torch.dtype) -> None:
    with open(os.path.join(directory, HF_CONFIG), "w") as f:
        json.dump(fp8.dequantised_config(info.hf_config), f, indent=2)
    with open(os.path.join(directory, SIDECAR), "w") as f:
        json.dump({"format": info.family.checkpoint_format, "version": 1, "vocab_size": info.vocab_size,
                   "padded_vocab_size": info.shape.vocab_size,
                   "dtype": str(dtype).replace("torch.", "")}, f, indent=2)


def read_mcore_info(mcore_dir: str, hf_config: str = None) -> ModelInfo:
    """ModelInfo of a megatron checkpoint: from `hf_config` if given, else the checkpoint's own
    hf_config.json (written by hf-to-mcore). Also checks that the checkpoint's metadata and common
    state are plain data, and that hf_config.json and the hf_files/ that mcore-to-hf copies lie
    inside the folder (ConversionError naming the file otherwise)."""
    if not os.path.isfile(os.path.join(mcore_dir, "metadata.json")):
        raise ConversionError(f"{mcore_dir}: not a megatron-core distributed checkpoint "
                              f"(no metadata.json)")
    from megatron_lora.convert.dcp_read import TorchDistCheckpoint

    TorchDistCheckpoint(mcore_dir)  # its files are plain data (read safely), before any collective
    path = hf_config or folder_file(mcore_dir, HF_CONFIG, ConversionError)  # no symlink out
    kept = os.path.join(mcore_dir, HF_FILES)
    if os.path.isdir(folder_file(mcore_dir, HF_FILES, ConversionError)):  # copied by mcore-to-hf
        for name in sorted(os.listdir(kept)):
            folder_file(mcore_dir, os.path.join(HF_FILES, name), ConversionError)
    if not os.path.exists(path):
        raise ConversionError(
            f"{mcore_dir}: no {HF_CONFIG}; pass the model's HF config.json (--hf-config)")
    return read_hf_config(path)


def _nbytes(sizes, dtype) -> int:
    n = dtype.itemsize
    for s in sizes:
        n *= s
    return n
