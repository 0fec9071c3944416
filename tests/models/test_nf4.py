"""NF4 (models/nf4.py): the dequantised values are bitsandbytes' own round trip of each part,
for whole weights, fused weights (q/k/v, gate/up: each part quantised on its own) and every
shard a layout cuts (rows with a partition stride, 64-column slices), with several second-level
groups (more than 256 blocks) in play."""

import pytest
import torch

bnbf = pytest.importorskip("bitsandbytes.functional")

from megatron_lora.models import nf4 as N  # noqa: E402


def bnb_round_trip(w):
    """bitsandbytes' dequantize_4bit(quantize_4bit(w)) with QLoRA's settings."""
    q, state = bnbf.quantize_4bit(w.contiguous(), blocksize=64, quant_type="nf4",
                                  compress_statistics=True)
    return bnbf.dequantize_4bit(q, state)


@pytest.fixture(scope="module")
def weights():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(600, 128, generator=g) * 0.05  # 1200 blocks: 5 second-level groups
    w[7, 3] = 2.0  # one large block scale: the offset and its group differ from the rest
    return w


def test_whole_weight_is_bitsandbytes_round_trip(weights):
    packed = N.quantize_parts(weights)
    assert packed.scale2.numel() == 5 and packed.codes.dtype == torch.uint8
    assert torch.equal(N.dequantize(packed), bnb_round_trip(weights))
    bf16 = weights.bfloat16()
    assert torch.equal(N.dequantize(N.quantize_parts(bf16), torch.bfloat16), bnb_round_trip(bf16))


def test_fused_parts_are_quantised_each_on_its_own(weights):
    # q/k/v as linear_qkv fuses them: per query group 2 q heads, 1 k head, 1 v head (d = 50).
    q, k, v = weights[:300], weights[300:450], weights[450:]
    d, per_group = 50, 100
    segments, rows = [], []
    for j in range(3):
        segments += [(0, j * per_group, per_group), (1, j * d, d), (2, j * d, d)]
        rows += [q[j * per_group:(j + 1) * per_group], k[j * d:(j + 1) * d], v[j * d:(j + 1) * d]]
    fused = torch.cat(rows)
    packed = N.quantize_parts(fused, segments)
    rq, rk, rv = bnb_round_trip(q), bnb_round_trip(k), bnb_round_trip(v)
    expected = torch.cat([t[j * n:(j + 1) * n] for j in range(3)
                          for t, n in ((rq, per_group), (rk, d), (rv, d))])
    assert torch.equal(N.dequantize(packed), expected)
    # The fused weight quantised as one tensor has other offsets and groups: not the same.
    assert not torch.equal(N.dequantize(N.quantize_parts(fused)), expected)


def test_shards_are_slices_of_the_round_trip(weights):
    gate, up = weights[:300], weights[300:]
    packed = N.quantize_parts(weights, [(0, 0, 300), (1, 0, 300)])
    whole = torch.cat([bnb_round_trip(gate), bnb_round_trip(up)])
    # A gated fc1 at TP2 (partition stride 2): rank 1 holds [gate rows 150:300; up rows 150:300].
    rank1 = packed.rows([(150, 150), (450, 150)])
    assert torch.equal(N.dequantize(rank1), torch.cat([whole[150:300], whole[450:]]))
    # A row-parallel shard: input columns 64:128 of every row.
    assert torch.equal(N.dequantize(packed.columns(64, 64)), whole[:, 64:])
    with pytest.raises(ValueError, match="blocks of 64"):
        packed.columns(32, 64)


def test_refuses_widths_that_split_blocks():
    with pytest.raises(ValueError, match="multiple of 64"):
        N.quantize_parts(torch.randn(4, 96))


# Row-parallel column shards at real widths: 768 columns (Qwen3-30B-A3B's expert down projection
# input, 12 blocks per row), 2880 (GPT-OSS, 45) and 14336 (Mixtral, 224). A row's block count does
# not divide 256 there, so a second-level group spans rows and a shard's first block in the
# row-major part depends on its first column; at 128 columns (2 blocks per row) it does not.
# Enough rows for 3+ groups; rows scaled 0.01..1 so the groups' scales differ widely.
@pytest.mark.parametrize("cols,rows,shards", [(768, 48, (2, 4, 12)), (2880, 12, (5, 9, 45)),
                                              (14336, 3, (2, 7, 8))])
def test_column_shards_at_real_widths_are_slices_of_the_round_trip(cols, rows, shards):
    from megatron_lora.testing.compare import assert_within

    g = torch.Generator().manual_seed(cols)
    w = torch.randn(rows, cols, generator=g) * torch.linspace(0.01, 1.0, rows).unsqueeze(1)
    packed = N.quantize_parts(w)
    assert packed.scale2.numel() >= 3
    whole = bnb_round_trip(w)
    for n in shards:
        width = cols // n
        for rank in range(n):
            first = rank * width
            assert_within(N.dequantize(packed.columns(first, width)),
                          whole[:, first:first + width], 0,  # bit for bit: the same arithmetic
                          f"{cols} columns, shard {rank} of {n} (columns {first}:{first + width})")
