"""MXFP4 expert weights (GPT-OSS's published checkpoints) dequantised one expert at a time.

The checkpoints store each expert projection `P` (`mlp.experts.gate_up_proj`, `down_proj`) as
two uint8 tensors: `P_blocks` [E, rows, G, 16], two 4-bit E2M1 codes per byte (low nibble first),
32 values per group, and `P_scales` [E, rows, G], one E8M0 exponent per group (2 ** (s - 127)).
Value j of group g of a row is FP4[code] * 2 ** (scale - 127). Rows are the projection's output
features: expert e's dequantised [rows, G * 32] is `W_e` in megatron's [out, in] orientation, the
transpose of transformers' `P[e]` ([in, out]): transformers' `convert_moe_packed_tensors`
returns the whole [E, in, out] stack, computed with the same table, in the same dtype, with the
same `ldexp`, so the values are bit for bit its values.

Streaming: `read_expert` reads one expert's blocks and scales through the checkpoint's slice
reader and dequantises `rows_per_chunk` rows at a time, so memory holds one expert's output and a
chunk's temporaries, never the [E, in, out] stack.
"""

from __future__ import annotations

import torch

from megatron_lora.convert.errors import ConversionError

# E2M1 codes 0..15: sign bit 3, then the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK_BYTES = 16  # 32 values per E8M0 scale
E8M0_BIAS = 127
E8M0_NAN = 255  # the one E8M0 code that is no power of two (read_expert refuses it)


def check_pair(name: str, blocks_shape, scales_shape, blocks_dtype, scales_dtype, where: str):
    """Raise ConversionError naming the tensor if `name`_blocks / `name`_scales cannot be a pair."""
    problems = []
    if blocks_dtype != torch.uint8 or scales_dtype != torch.uint8:
        problems.append(f"dtypes {blocks_dtype} / {scales_dtype} (both must be uint8)")
    if len(blocks_shape) < 2 or tuple(blocks_shape[:-1]) != tuple(scales_shape):
        problems.append(f"shapes {list(blocks_shape)} / {list(scales_shape)} (blocks must be the "
                        "scales' shape plus one axis of bytes)")
    elif blocks_shape[-1] != BLOCK_BYTES:
        problems.append(f"{blocks_shape[-1]} bytes per block (MXFP4 has {BLOCK_BYTES})")
    if problems:
        raise ConversionError(f"{where}: {name}_blocks / {name}_scales: " + "; ".join(problems))


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
               rows_per_chunk: int = 1 << 16) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in `dtype`."""
    check_pair("tensor", blocks.shape, scales.shape, blocks.dtype, scales.dtype, "dequantize")
    *prefix, groups, nbytes = blocks.shape
    rows = blocks.reshape(-1, nbytes)
    exps = scales.reshape(-1, 1).to(torch.int32) - E8M0_BIAS
    table = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(rows.shape[0], 2 * nbytes, dtype=dtype, device=blocks.device)
    for start in range(0, rows.shape[0], rows_per_chunk):
        stop = start + rows_per_chunk
        chunk, piece = rows[start:stop], out[start:stop]
        piece[:, 0::2] = table[(chunk & 0x0F).to(torch.int)]
        piece[:, 1::2] = table[(chunk >> 4).to(torch.int)]
        torch.ldexp(piece, exps[start:stop], out=piece)
    return out.view(*prefix, groups * 2 * nbytes)


def read_expert(ckpt, name: str, expert: int, dtype: torch.dtype = torch.bfloat16
                ) -> torch.Tensor:
    """Expert `expert`'s weight [rows, in] of MXFP4 projection `name` (without the suffixes)
    from an HFCheckpoint, reading only that expert's blocks and scales."""
    blocks_info, scales_info = ckpt.tensors.get(f"{name}_blocks"), ckpt.tensors.get(f"{name}_scales")
    if blocks_info is None or scales_info is None:
        raise ConversionError(f"{ckpt.directory}: {name}_blocks and {name}_scales must both be "
                              "in the checkpoint")
    check_pair(name, blocks_info.shape, scales_info.shape, blocks_info.dtype, scales_info.dtype,
               ckpt.directory)
    if not 0 <= expert < blocks_info.shape[0]:
        raise ConversionError(f"{ckpt.directory}: {name}_blocks has {blocks_info.shape[0]} "
                              f"experts, no expert {expert}")
    index = (slice(expert, expert + 1),)
    blocks = ckpt.read(f"{name}_blocks", index)[0]
    scales = ckpt.read(f"{name}_scales", index)[0]
    nan = scales == E8M0_NAN
    if bool(nan.any()):  # E8M0's NaN code: every value of its group would be NaN
        row, group = torch.nonzero(nan)[0].tolist()
        raise ConversionError(
            f"{ckpt.directory}/{scales_info.file}: tensor {name}_scales holds {int(nan.sum())} "
            f"scale(s) of {E8M0_NAN} (E8M0's NaN) for expert {expert} (first: row {row}, group "
            f"{group}: values {group * 2 * BLOCK_BYTES}..{(group + 1) * 2 * BLOCK_BYTES - 1}); "
            f"the checkpoint is corrupt: re-download it")
    return dequantize(blocks, scales, dtype)


__all__ = ["FP4_VALUES", "check_pair", "dequantize", "read_expert"]
