"""NF4, QLoRA's 4-bit format for a frozen weight, defined on the GLOBAL weight and cut into shards.

    packed = quantize_parts(w, segments)         # w [M, K]: a whole (global, maybe fused) weight
    shard = packed.rows([(start, count), ...])   # a column-parallel rank's rows
    shard = packed.columns(first, width)         # a row-parallel rank's input columns
    w_local = dequantize(shard, torch.bfloat16)  # exactly bitsandbytes' values, in that dtype

The format is bitsandbytes' `quantize_4bit(p, blocksize=64, quant_type="nf4",
compress_statistics=True)`, applied to each PART of the weight on its own: a fused megatron
weight is cut into the projections it fuses (linear_qkv: q, k, v; a gated fc1: gate, up), the
tensors QLoRA quantises in a Hugging Face model, each expert's matrix on its own. `segments`
says which rows of w come from which part: (part, first row in the part, rows) runs in w's row
order. Quantisation calls bitsandbytes (on CPU, in fp32), so the values are QLoRA's by
construction; dequantisation is bitsandbytes' dequantize_4bit kernel on CUDA (quant_states
builds the QuantState the stored values are) and plain torch elsewhere, the same values:
    value = nf4[code] * (dyn8[qabsmax[block]] * scale2[part][block // 256] + offset[part])
with `code` the element's 4-bit index (two per byte, the first element in the high nibble),
`qabsmax` the block's 8-bit double-quantised scale, `scale2` one fp32 per 256 blocks of the part
and `offset` the mean of the part's block scales. Blocks are 64 consecutive elements of the
row-major part; with K % 64 == 0 every block is 64 input columns of one output row, so a
column-parallel shard (whole rows) and a row-parallel shard (a multiple of 64 columns of every
row) hold whole blocks and their values do not depend on the layout. Each shard keeps its codes
(M K / 2 bytes) and block scales (M K / 64 bytes), every part's small `scale2` vector (one
concatenated fp32 vector) and `offset`, and where its rows and columns lie in the parts, from
which each block's `scale2` entry is recomputed at dequantisation (no per-block index is
stored). The two code books (16 and 256 fp32 values, bitsandbytes' constants) are held once per
device, not per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Tuple

import torch

BLOCK = 64  # elements per block scale (bitsandbytes' blocksize)
GROUP = 256  # block scales per second-level scale (bitsandbytes' nested blocksize)

_BOOKS: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}


class NF4Unavailable(RuntimeError):
    """bitsandbytes (the `qlora` extra) is not installed."""


def _bnb():
    try:
        import bitsandbytes.functional as bnbf
    except Exception as exc:  # ImportError, or a broken native library
        raise NF4Unavailable(
            "--base-quantization nf4 needs bitsandbytes: pip install 'megatron-lora[qlora]' "
            f"({type(exc).__name__}: {exc})") from None
    return bnbf


@dataclass(frozen=True)
class NF4Shard:
    """Part (or all) of one NF4 weight.

    codes uint8 [m, k/2], qabsmax uint8 [m, k/64]: this shard's elements and block scales.
    scale2 fp32 [sum over parts of ceil(blocks / 256)]: every part's second-level scales, part
        after part; offsets fp32 [parts]: each part's mean block scale.
    global_cols: K; col0: the shard's first global column.
    runs: this shard's rows in order, as (rows, part, first row in the part, the part's first
        index in scale2) runs.
    """

    codes: torch.Tensor
    qabsmax: torch.Tensor
    scale2: torch.Tensor
    offsets: torch.Tensor
    global_cols: int
    runs: Tuple[Tuple[int, int, int, int], ...]
    col0: int = 0

    @property
    def shape(self) -> Tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 2

    @property
    def layout(self) -> tuple:
        """The plain-data part of the shard: (global_cols, runs, col0)."""
        return self.global_cols, self.runs, self.col0

    def _whole(self) -> None:
        if self.col0 or self.shape[1] != self.global_cols:
            raise ValueError("a shard is cut from a whole weight")

    def rows(self, ranges) -> "NF4Shard":
        """The rows [start, start + count) for each (start, count) in ranges, concatenated."""
        self._whole()
        idx, runs = [], []
        for start, count in ranges:
            idx.append(torch.arange(start, start + count, device="cpu"))
            first = 0
            for n, part, row0, base in self.runs:
                lo, hi = max(start, first), min(start + count, first + n)
                if lo < hi:
                    runs.append((hi - lo, part, row0 + lo - first, base))
                first += n
        idx = torch.cat(idx)
        return replace(self, codes=self.codes[idx].contiguous(),
                       qabsmax=self.qabsmax[idx].contiguous(), runs=tuple(runs))

    def columns(self, first: int, width: int) -> "NF4Shard":
        """The input columns [first, first + width) of every row (multiples of 64)."""
        self._whole()
        if first % BLOCK or width % BLOCK:
            raise ValueError(f"NF4 column shards start and end on blocks of {BLOCK}: "
                             f"columns [{first}, {first + width})")
        return replace(self, codes=self.codes[:, first // 2:(first + width) // 2].contiguous(),
                       qabsmax=self.qabsmax[:, first // BLOCK:(first + width) // BLOCK]
                       .contiguous(), col0=first)

    def to(self, device) -> "NF4Shard":
        return replace(self, **{n: getattr(self, n).to(device) for n in
                                ("codes", "qabsmax", "scale2", "offsets")})


def block_scale_index(layout: tuple, m: int, k: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(int64 [m, k/64] each local block's index into scale2, int64 [m] each row's part), from
    a shard's `layout` (recomputed per use: nothing per block is stored)."""
    global_cols, runs, col0 = layout
    per_row = global_cols // BLOCK
    cols = torch.arange(k // BLOCK, device=device) + col0 // BLOCK
    groups, parts = [], []
    for n, part, row0, base in runs:
        rows = torch.arange(row0, row0 + n, device=device)
        groups.append((rows.unsqueeze(1) * per_row + cols) // GROUP + base)
        parts.append(torch.full((n,), part, dtype=torch.int64, device=device))
    if sum(r[0] for r in runs) != m:
        raise ValueError(f"NF4 layout covers {sum(r[0] for r in runs)} rows, not {m}")
    return torch.cat(groups), torch.cat(parts)


def _quantize(p: torch.Tensor):
    bnbf = _bnb()
    pairs, dyn8 = code_books("cpu")
    flat = p.detach().to(device="cpu", dtype=torch.float32).contiguous()
    packed, state = bnbf.quantize_4bit(flat, blocksize=BLOCK, quant_type="nf4",
                                       compress_statistics=True)
    if not (torch.equal(state.code.float(), pairs[:16, 1]) and
            torch.equal(state.state2.code.float(), dyn8)):
        raise RuntimeError("bitsandbytes quantised with other code books than NF4's")
    m, k = p.shape
    return (packed.view(torch.uint8).reshape(m, k // 2), state.absmax.reshape(m, k // BLOCK),
            state.state2.absmax.float(), torch.as_tensor(state.offset, dtype=torch.float32, device="cpu"))


def quantize_parts(w: torch.Tensor, segments=None) -> NF4Shard:
    """The NF4 form of one whole weight w [M, K] (K a multiple of 64), on CPU, each part
    quantised by bitsandbytes on its own. segments: (part, first part row, rows) runs covering
    w's rows in order (default: w is one part); a part's runs must cover its rows."""
    if w.dim() != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"NF4 weights are [out, in] with in a multiple of {BLOCK}; got "
                         f"{list(w.shape)}")
    m, k = w.shape
    segments = [(0, 0, m)] if segments is None else list(segments)
    if sum(n for _, _, n in segments) != m:
        raise ValueError(f"NF4 segments cover {sum(n for _, _, n in segments)} rows, not {m}")
    nparts = max(p for p, _, _ in segments) + 1
    sizes = [0] * nparts
    for part, row0, n in segments:
        sizes[part] = max(sizes[part], row0 + n)
    parts = [w.new_empty((sizes[p], k)) for p in range(nparts)]
    first = 0
    for part, row0, n in segments:
        parts[part][row0:row0 + n] = w[first:first + n]
        first += n
    quantised = [_quantize(p) for p in parts]
    bases, base = [], 0
    for _, _, scale2, _ in quantised:
        bases.append(base)
        base += scale2.numel()
    codes = torch.cat([quantised[p][0][r:r + n] for p, r, n in segments])
    qabsmax = torch.cat([quantised[p][1][r:r + n] for p, r, n in segments])
    return NF4Shard(codes=codes.contiguous(), qabsmax=qabsmax.contiguous(),
                    scale2=torch.cat([q[2] for q in quantised]).contiguous(),
                    offsets=torch.stack([q[3].reshape(()) for q in quantised]).contiguous(),
                    global_cols=k, runs=tuple((n, p, r, bases[p]) for p, r, n in segments))


def nf4_code(device) -> torch.Tensor:
    """The 16 NF4 values, fp32 on device (bitsandbytes' code for quant_type nf4)."""
    pairs, _ = code_books(device)
    return pairs[::16, 0].contiguous()


def code_books(device) -> Tuple[torch.Tensor, torch.Tensor]:
    """(pairs [256, 2], dyn8 [256]) fp32 on device: the NF4 values of both nibbles of every
    byte (high nibble first) and bitsandbytes' signed dynamic 8-bit code; made once per device."""
    key = str(torch.device(device))
    books = _BOOKS.get(key)
    if books is None:
        bnbf = _bnb()
        nf4 = bnbf.get_4bit_type("nf4", device="cpu").float()
        byte = torch.arange(256, device="cpu")
        pairs = torch.stack([nf4[byte >> 4], nf4[byte & 15]], dim=1)
        dyn8 = bnbf.create_dynamic_map(signed=True).float()
        books = (pairs.to(device).contiguous(), dyn8.to(device).contiguous())
        _BOOKS[key] = books
    return books


def block_absmax(qabsmax, scale2, offsets, layout, k: int) -> torch.Tensor:
    """fp32 [m, k/64]: each block's scale, dyn8[qabsmax] * scale2[group] + offset[part] (in
    bitsandbytes' order: the product rounded to fp32, then the offset added)."""
    m = qabsmax.shape[0]
    _, dyn8 = code_books(qabsmax.device)
    groups, parts = block_scale_index(layout, m, k, qabsmax.device)
    return dyn8[qabsmax.long()] * scale2[groups] + offsets[parts].unsqueeze(1)


def quant_states(codes, qabsmax, scale2, offsets, layout, dtype: torch.dtype) -> list:
    """[(first row, end row, bitsandbytes QuantState)] covering the shard's rows: what
    `bitsandbytes.functional.dequantize_4bit(codes[r0:r1].reshape(-1, 1), state)` turns into
    those rows in dtype (the values of dequantize_parts, bit for bit). Each run of rows of one
    part that starts on a group of 256 blocks of its part and holds whole rows gets the nested
    state quantize_4bit returned for the part, cut to the run (uint8 block scales, its scale2
    slice as state2, the part's offset); otherwise (a row-parallel shard's columns, a run
    starting inside a group) one plain state for all rows with the fp32 block scales."""
    bnbf = _bnb()
    m, half = codes.shape
    k = half * 2
    global_cols, runs, col0 = layout
    per_row = global_cols // BLOCK
    _, dyn8 = code_books(codes.device)
    nf4 = nf4_code(codes.device)
    whole = col0 == 0 and k == global_cols
    if not whole or any((row0 * per_row) % GROUP for _, _, row0, _ in runs):
        absmax = block_absmax(qabsmax, scale2, offsets, layout, k).reshape(-1)
        return [(0, m, bnbf.QuantState(absmax=absmax, shape=(m, k), code=nf4, blocksize=BLOCK,
                                        quant_type="nf4", dtype=dtype))]
    states, r = [], 0
    for n, part, row0, base in runs:
        first = row0 * per_row  # the run's first block in its part
        g0, g1 = base + first // GROUP, base + -(-(first + n * per_row) // GROUP)
        state2 = bnbf.QuantState(absmax=scale2[g0:g1], code=dyn8, blocksize=GROUP,
                                 dtype=torch.float32)
        states.append((r, r + n, bnbf.QuantState(
            absmax=qabsmax[r:r + n].reshape(-1), shape=(n, k), code=nf4, blocksize=BLOCK,
            quant_type="nf4", dtype=dtype, offset=offsets[part], state2=state2)))
        r += n
    return states


def dequantize_bnb(codes, qabsmax, scale2, offsets, layout, dtype: torch.dtype,
                   out=None) -> torch.Tensor:
    """[m, k] in dtype by bitsandbytes' dequantize_4bit kernel (on the codes' device), into
    `out` when given (a contiguous [m, k] tensor in dtype, e.g. a buffer reused per expert)."""
    bnbf = _bnb()
    m, half = codes.shape
    if out is None:
        out = torch.empty((m, half * 2), dtype=dtype, device=codes.device)
    for r0, r1, state in quant_states(codes, qabsmax, scale2, offsets, layout, dtype):
        packed = codes[r0:r1].reshape(-1, 1)  # bitsandbytes' [(n k + 1) // 2, 1] packed form
        if out.is_cuda:
            bnbf.dequantize_4bit(packed, state, out=out[r0:r1])
        else:  # bitsandbytes' CPU backend has no `out=` variant of the op
            out[r0:r1].copy_(bnbf.dequantize_4bit(packed, state))
    return out


_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the kernel writes


def uses_bnb_kernel(device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether dequantize_parts calls bitsandbytes' kernel for this device and dtype: on CUDA,
    in the dtypes it writes (plain torch, the same values, otherwise)."""
    return torch.device(device).type == "cuda" and dtype in _KERNEL_DTYPES


def dequantize_parts(codes, qabsmax, scale2, offsets, layout, dtype: torch.dtype,
                     out=None) -> torch.Tensor:
    """[m, k] in dtype from the stored tensors and layout (see NF4Shard); fp32 arithmetic as
    bitsandbytes does it (block scale = dyn8 * scale2 + offset, value = nf4 * block scale).
    On CUDA bitsandbytes' own kernel (dequantize_bnb); elsewhere plain torch. out: an optional
    contiguous [m, k] tensor in dtype to write into."""
    if uses_bnb_kernel(codes.device, dtype):
        return dequantize_bnb(codes, qabsmax, scale2, offsets, layout, dtype, out)
    m, half = codes.shape
    pairs, _ = code_books(codes.device)
    absmax = block_absmax(qabsmax, scale2, offsets, layout, half * 2)  # [m, k/64]
    # int32 indices: half the transient of int64 ones and about twice as fast to gather here
    values = pairs[codes.int()].view(m, half * 2 // BLOCK, BLOCK)
    w = (values * absmax.unsqueeze(-1)).view(m, half * 2).to(dtype)
    return w if out is None else out.copy_(w)


def dequantize(shard: NF4Shard, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This shard's weight [m, k] in dtype."""
    return dequantize_parts(shard.codes, shard.qabsmax, shard.scale2, shard.offsets,
                            shard.layout, dtype)


__all__ = ["BLOCK", "NF4Shard", "NF4Unavailable", "block_absmax", "block_scale_index",
           "code_books", "dequantize", "dequantize_bnb", "dequantize_parts", "nf4_code",
           "quant_states", "quantize_parts", "uses_bnb_kernel"]
