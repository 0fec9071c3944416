"""NF4 on CUDA dequantises with bitsandbytes' own kernel (models/nf4.py quant_states,
dequantize_bnb). No GPU here, so the QuantStates the CUDA path hands to
`bitsandbytes.functional.dequantize_4bit` are checked on bitsandbytes' CPU backend: they
reproduce the plain-torch dequantisation bit for bit for every layout a shard can have, and for a
whole weight they are the state quantize_4bit itself returned."""

import pytest
import torch

bnbf = pytest.importorskip("bitsandbytes.functional")

from megatron_lora.models import nf4 as N  # noqa: E402

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(scope="module")
def fused():
    """A gated fc1-like weight [gate; up]: parts of 200 and 400 rows of 128 columns (400 and 800
    blocks: 2 and 4 second-level groups, the last ones partial), one large scale for an offset
    and a group unlike the rest."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(600, 128, generator=g) * 0.05
    w[250, 5] = 1.5
    return N.quantize_parts(w, [(0, 0, 200), (1, 0, 400)])


def _shards(packed):
    return {
        "whole": packed,
        # column-parallel rows at group boundaries (row 128 x 2 blocks = block 256): nested
        "rows_on_groups": packed.rows([(0, 128), (200 + 128, 128)]),
        # rows starting inside a group of 256 blocks, and a one-row shard: the plain state
        "rows_inside_group": packed.rows([(3, 61), (200 + 5, 7)]),
        "one_row": packed.rows([(77, 1)]),
        # a row-parallel shard's input columns: blocks not laid out as in the part
        "columns": packed.columns(64, 64),
    }


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["whole", "rows_on_groups", "rows_inside_group", "one_row",
                                  "columns"])
def test_bitsandbytes_kernel_states_give_the_torch_values_bit_for_bit(fused, name, dtype):
    s = _shards(fused)[name]
    states = N.quant_states(s.codes, s.qabsmax, s.scale2, s.offsets, s.layout, dtype)
    nested = [st.nested for _, _, st in states]
    # Whole rows from a group boundary take the nested (stored) form; the others the plain one.
    assert nested == {"whole": [True, True], "rows_on_groups": [True, True]}.get(
        name, [False]), nested
    assert [(r0, r1) for r0, r1, _ in states][0][0] == 0 and states[-1][1] == s.shape[0]
    torch_values = N.dequantize(s, dtype)
    by_kernel = N.dequantize_bnb(s.codes, s.qabsmax, s.scale2, s.offsets, s.layout, dtype)
    direct = torch.cat([bnbf.dequantize_4bit(s.codes[r0:r1].reshape(-1, 1), st)
                        for r0, r1, st in states])
    for what, got in (("dequantize_bnb", by_kernel), ("dequantize_4bit per state", direct)):
        assert got.dtype == dtype and got.shape == torch_values.shape
        assert torch.equal(got, torch_values), (
            f"{name} {dtype} {what}: {(got != torch_values).sum().item()} elements differ")


def test_whole_weight_state_is_the_one_quantize_4bit_returned():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(96, 192, generator=g) * 0.1  # 288 blocks: two groups, the second partial
    packed = N.quantize_parts(w)
    q, ref = bnbf.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    [(r0, r1, st)] = N.quant_states(packed.codes, packed.qabsmax, packed.scale2, packed.offsets,
                                    packed.layout, torch.float32)
    assert (r0, r1) == (0, 96) and st.nested
    assert torch.equal(packed.codes.reshape(-1, 1), q.view(torch.uint8))
    assert tuple(st.shape) == tuple(ref.shape) and st.dtype == ref.dtype
    assert (st.blocksize, st.quant_type) == (ref.blocksize, ref.quant_type)
    assert torch.equal(st.code, ref.code.float())
    assert torch.equal(st.absmax, ref.absmax)
    assert torch.equal(st.offset, ref.offset.reshape(()))
    assert st.state2.blocksize == ref.state2.blocksize
    assert torch.equal(st.state2.absmax, ref.state2.absmax.float())
    assert torch.equal(st.state2.code, ref.state2.code.float())
    assert torch.equal(bnbf.dequantize_4bit(q, st), bnbf.dequantize_4bit(q, ref))


def test_the_kernel_is_chosen_on_cuda_in_its_dtypes_only():
    assert N.uses_bnb_kernel("cuda") and N.uses_bnb_kernel(torch.device("cuda", 1))
    assert not N.uses_bnb_kernel("cpu") and not N.uses_bnb_kernel("meta")
    assert all(N.uses_bnb_kernel("cuda", dtype) for dtype in DTYPES)
    assert not N.uses_bnb_kernel("cuda", torch.float64)  # not a dtype the kernel writes


def test_out_buffer_is_written(fused):
    s = _shards(fused)["rows_on_groups"]
    buffer = torch.full(s.shape, float("nan"), dtype=torch.bfloat16)
    got = N.dequantize_bnb(s.codes, s.qabsmax, s.scale2, s.offsets, s.layout, torch.bfloat16,
                           out=buffer)
    assert got is buffer and torch.equal(buffer, N.dequantize(s, torch.bfloat16))
    again = N.dequantize_parts(s.codes, s.qabsmax, s.scale2, s.offsets, s.layout,
                               torch.bfloat16, out=torch.empty_like(buffer))
    assert torch.equal(again, buffer)
