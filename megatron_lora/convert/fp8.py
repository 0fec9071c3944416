"""Fine-grained FP8 weights (DeepSeek-V3/R1, Kimi-K2, ...) dequantised as they are read.

Format. config.json has `quantization_config` {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [bm, bn], "activation_scheme": "dynamic"}; a quantised tensor `X.weight`
[..., M, N] is stored as float8_e4m3fn beside `X.weight_scale_inv` [..., ceil(M / bm),
ceil(N / bn)] (fp32, or bf16 / fp16), one scale per bm x bn block; the last block row / column
covers what is left when M or N is not a multiple (edge blocks). Value (i, j) is
fp32(weight[i, j]) * fp32(scale_inv[i // bm, j // bn]), rounded once to the output dtype.
Tensors stored in another dtype (norms, embeddings, routers a checkpoint keeps in bf16) are read
as they are. Which tensors are quantised is read from the files (an FP8 tensor with its scale),
so this serves any family.

Exactness. The order (both operands cast to fp32, the product in fp32, one rounding to the
output dtype) is transformers 5.24's on-load dequantisation (`Fp8Dequantize._dequantize_one`,
integrations/finegrained_fp8.py), so values are its values bit for bit. transformers derives the
block size there from the scale grid (M // grid rows), which is the configured size only when M
and N are multiples of it: otherwise it refuses the tensor (80 rows in 3 blocks of 32) or uses
other blocks (90 rows in 3 blocks of 30). Here the block is the configured one, as in
transformers' `_dequantize_fp8_weight` (its backward pass) and its quantiser's layout; with an
fp32 product the two agree bit for bit (tests/convert/test_fp8.py).

Streaming. `FP8Checkpoint.read(name, index)` reads only the blocks covering the requested box
(weight rows / columns rounded out to block edges, and their scales) and dequantises
`rows_per_chunk` rows at a time, so memory holds the box's output, its FP8 bytes and one chunk's
fp32 temporaries, never a whole dequantised checkpoint.

Refused as they are read, naming the file, the tensor and the block: an FP8 weight holding NaN
codes, and a block scale that is not a positive finite number (NaN, inf, zero or negative: every
value of its block would be NaN, inf, zero or sign-flipped) (convert/finite.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

import torch

from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.finite import check_finite, check_scales

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# quantization_config methods whose weights conversion dequantises (mxfp4: convert/mxfp4.py).
DEQUANTISED_METHODS = ("fp8", "mxfp4")
CHUNK_BYTES = 1 << 24  # fp32 bytes of one row chunk's product


@dataclass(frozen=True)
class FP8Format:
    block: Tuple[int, int]  # (rows, columns) of one scale's block


def read_format(cfg: dict, where: str) -> Optional[FP8Format]:
    """The FP8 format config.json's `quantization_config` describes; None when the checkpoint is
    not FP8 (no quantization_config, or MXFP4). Raises ConversionError naming the field for what
    is not read exactly: another method, fmt, activation scheme, scale format or block size."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConversionError(f"{where}: quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method == "mxfp4":
        return None
    if method != "fp8":
        raise ConversionError(
            f"{where}: quantization_config.quant_method={method!r} is not supported (only 'fp8' "
            "block-scaled and 'mxfp4' checkpoints are dequantised); convert the model to "
            "bf16 / fp32 safetensors first")
    problems = []
    if q.get("fmt", "e4m3") != "e4m3":
        problems.append(f"fmt={q['fmt']!r} (only 'e4m3', float8_e4m3fn weights)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        problems.append(f"activation_scheme={q['activation_scheme']!r} (only 'dynamic': static "
                        "activation scales would change what the model computes)")
    if q.get("scale_fmt", "float") not in ("float", "ue8m0"):
        problems.append(f"scale_fmt={q['scale_fmt']!r} (only 'float' or 'ue8m0' with the scales "
                        "stored as floats)")
    if q.get("expert_dtype", "fp8") != "fp8":
        problems.append(f"expert_dtype={q['expert_dtype']!r} (only 'fp8')")
    block = q.get("weight_block_size", [128, 128])
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        problems.append(f"weight_block_size={block!r} (must be two positive integers; one "
                        "scale per tensor is not supported)")
    if problems:
        raise ConversionError(f"{where}: quantization_config " + "; ".join(problems))
    return FP8Format(tuple(block))


def scale_shape(shape, block) -> Tuple[int, ...]:
    """The scale grid of a weight of `shape` [..., M, N]: [..., ceil(M / bm), ceil(N / bn)]."""
    *lead, m, n = shape
    return (*lead, -(-m // block[0]), -(-n // block[1]))


def quantized_weights(ckpt, fmt: Optional[FP8Format], where: str) -> Dict[str, str]:
    """{FP8 tensor name: its scale's name} of an HFCheckpoint, every pair checked. Raises
    ConversionError naming the tensor for an FP8 tensor without fp8 quantization_config or without
    its scale, a scale beside no FP8 tensor, or a scale of the wrong dtype or shape."""
    tensors, pairs = ckpt.tensors, {}
    for name in sorted(tensors):
        info = tensors[name]
        path = os.path.join(ckpt.directory, info.file)
        if name.endswith(SCALE_SUFFIX):
            weight = tensors.get(name[: -len(SCALE_SUFFIX)])
            if weight is None or weight.dtype != FP8_DTYPE:
                raise ConversionError(
                    f"{path}: tensor {name!r} is a block scale, but {name[: -len(SCALE_SUFFIX)]!r} "
                    f"is {'missing' if weight is None else str(weight.dtype)} (a scale belongs "
                    "beside a float8_e4m3fn weight)")
            continue
        if not info.dtype.is_floating_point or info.dtype.itemsize != 1:
            continue
        if info.dtype != FP8_DTYPE:
            raise ConversionError(f"{path}: tensor {name!r} is {info.dtype}; only float8_e4m3fn "
                                  "weights (quantization_config.fmt 'e4m3') are read")
        if fmt is None:
            raise ConversionError(
                f"{path}: tensor {name!r} is float8_e4m3fn but {where} has no quantization_config "
                "with quant_method 'fp8' (which gives weight_block_size)")
        scale = tensors.get(name + SCALE_SUFFIX)
        if scale is None:
            raise ConversionError(f"{path}: tensor {name!r} is float8_e4m3fn but "
                                  f"{name + SCALE_SUFFIX!r} is missing from the checkpoint")
        want = scale_shape(info.shape, fmt.block) if len(info.shape) >= 2 else None
        if want is None or tuple(scale.shape) != want or scale.dtype not in SCALE_DTYPES:
            raise ConversionError(
                f"{os.path.join(ckpt.directory, scale.file)}: tensor {name + SCALE_SUFFIX!r} has "
                f"shape {list(scale.shape)} and dtype {scale.dtype}, but {name!r} "
                f"{list(info.shape)} with {where} quantization_config.weight_block_size "
                f"{list(fmt.block)} implies "
                f"{list(want) if want else 'a weight of 2 or more dimensions'} "
                "in fp32 / bf16 / fp16")
        pairs[name] = name + SCALE_SUFFIX
    return pairs


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128),
               dtype: torch.dtype = torch.bfloat16, rows_per_chunk: Optional[int] = None
               ) -> torch.Tensor:
    """weight float8_e4m3fn [..., M, N], scale_inv [..., ceil(M / bm), ceil(N / bn)] ->
    [..., M, N] in `dtype`: fp32(weight) * fp32(scale of its block), rounded once to `dtype`.
    rows_per_chunk (rounded down to whole blocks, at least one): rows dequantised at a time
    (default: about CHUNK_BYTES of fp32 per chunk)."""
    bm, bn = block
    if weight.dtype != FP8_DTYPE or weight.dim() < 2 or \
            tuple(scale_inv.shape) != scale_shape(weight.shape, block):
        raise ConversionError(
            f"dequantize: weight {weight.dtype} {list(weight.shape)} and scale_inv "
            f"{list(scale_inv.shape)} are not a float8_e4m3fn weight with its {bm}x{bn} block "
            f"scales ({list(scale_shape(weight.shape, block)) if weight.dim() >= 2 else '-'})")
    *lead, m, n = weight.shape
    if rows_per_chunk is None:
        rows_per_chunk = CHUNK_BYTES // (4 * max(n, 1))
    step = max(1, rows_per_chunk // bm) * bm
    w, s = weight.reshape(-1, m, n), scale_inv.reshape(-1, *scale_inv.shape[-2:])
    out = torch.empty(w.shape, dtype=dtype, device=weight.device)
    whole = n // bn * bn  # columns in whole blocks; the rest share the last scale column
    for k in range(w.shape[0]):
        for r0 in range(0, m, step):
            r1 = min(r0 + step, m)
            scale = s[k, r0 // bm: -(-r1 // bm)].to(torch.float32)
            scale = scale.repeat_interleave(bm, 0)[: r1 - r0]  # [rows, grid columns]
            chunk = w[k, r0:r1].to(torch.float32)
            chunk[:, :whole].unflatten(1, (n // bn, bn)).mul_(scale[:, : n // bn, None])
            chunk[:, whole:].mul_(scale[:, n // bn:])
            out[k, r0:r1] = chunk.to(dtype)
    return out.reshape(weight.shape)


class FP8Checkpoint:
    """An HFCheckpoint whose FP8 tensors read as `dtype` (their scales consumed, not listed).

    `tensors`, `read(name, index)`, `directory` and `total_bytes()` are HFCheckpoint's; reading
    part of an FP8 tensor (a TP rank's rows, one expert's columns) reads only the blocks that
    cover it. weights: {FP8 tensor name: scale name} (quantized_weights)."""

    def __init__(self, ckpt, weights: Dict[str, str], block: Tuple[int, int],
                 dtype: torch.dtype):
        self.ckpt, self.weights, self.block, self.dtype = ckpt, dict(weights), tuple(block), dtype
        self.directory = ckpt.directory
        scales = set(self.weights.values())
        self.tensors = {n: replace(i, dtype=dtype) if n in self.weights else i
                        for n, i in ckpt.tensors.items() if n not in scales}

    def total_bytes(self) -> int:
        return self.ckpt.total_bytes()

    def read(self, name: str, index=None) -> torch.Tensor:
        if name not in self.weights:
            return self.ckpt.read(name, index)
        shape = self.ckpt.tensors[name].shape
        index = tuple(index or ()) + (slice(None),) * (len(shape) - len(index or ()))
        spans = [s.indices(n) for s, n in zip(index, shape)]
        if any(step != 1 for _, _, step in spans):
            raise ConversionError(f"{self.directory}: {name!r}: only unit-step slices are read")
        (r0, r1, _), (c0, c1, _) = spans[-2:]
        (bm, bn), (m, n) = self.block, shape[-2:]
        rows = slice(r0 // bm * bm, min(-(-r1 // bm) * bm, m))
        cols = slice(c0 // bn * bn, min(-(-c1 // bn) * bn, n))
        lead = tuple(slice(a, b) for a, b, _ in spans[:-2])
        weight = self.ckpt.read(name, lead + (rows, cols))
        grid = (slice(rows.start // bm, -(-rows.stop // bm)),
                slice(cols.start // bn, -(-cols.stop // bn)))
        scale = self.ckpt.read(self.weights[name], lead + grid)  # finite (HFCheckpoint.read)
        check_scales(scale, self.weights[name],
                     os.path.join(self.directory, self.ckpt.tensors[self.weights[name]].file),
                     self.block, [s.start for s in lead + grid])
        data = dequantize(weight, scale, self.block, self.dtype)
        # a finite scale can still overflow the product (1e38 x 448): inf weights
        check_finite(data, f"{name} (dequantised)",
                     os.path.join(self.directory, self.ckpt.tensors[name].file),
                     [s.start for s in lead] + [rows.start, cols.start])
        box = data[..., r0 - rows.start: r1 - rows.start, c0 - cols.start: c1 - cols.start]
        return box if box.shape == data.shape else box.contiguous()


def dequantised_config(cfg: dict) -> dict:
    """A copy of config.json without the quantization_config of weights conversion dequantised
    (FP8, MXFP4): what describes the bf16 / fp32 tensors hf-to-mcore writes and mcore-to-hf gives
    back. Other configs are returned as they are."""
    q = cfg.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") in DEQUANTISED_METHODS:
        return {k: v for k, v in cfg.items() if k != "quantization_config"}
    return cfg


__all__ = ["FP8Checkpoint", "FP8Format", "dequantize", "dequantised_config", "quantized_weights",
           "read_format", "scale_shape"]
