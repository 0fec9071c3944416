"""MXFP4 dequantisation (convert/mxfp4.py) against transformers 5.24's own
`convert_moe_packed_tensors`, bit for bit.

The blocks and E8M0 scales are made here: random codes for all 16 E2M1 values, exponents around
the bias and at both ends of the E8M0 range (0 and 255: subnormal and infinite results), three
experts of a [rows, G, 16] projection. Every expert read one at a time from a safetensors file
(only its slice) and dequantised in chunks of a few rows equals transformers' whole-stack result
transposed to megatron's [out, in], in bf16 and fp32, compared as raw bits.
"""

import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from megatron_lora.convert import mxfp4
from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.hf_files import HFCheckpoint

E, ROWS, GROUPS = 3, 10, 4
NAME = "model.layers.0.mlp.experts.gate_up_proj"


def _pair(seed=0):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, ROWS, GROUPS, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(107, 148, (E, ROWS, GROUPS), generator=g, dtype=torch.uint8)
    scales[0, 0, :2] = torch.tensor([0, 254], dtype=torch.uint8)  # 255 is NaN: refused
    scales[1, 2, 1] = 1
    scales[2, 9, 3] = 254
    return blocks, scales


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_streamed_experts_equal_transformers_bit_for_bit(tmp_path, dtype):
    blocks, scales = _pair()
    save_file({f"{NAME}_blocks": blocks, f"{NAME}_scales": scales},
              str(tmp_path / "model.safetensors"))
    theirs = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)  # [E, in, out]
    assert theirs.shape == (E, GROUPS * 32, ROWS)
    assert torch.isinf(theirs).any()  # the edge exponents bite
    ckpt = HFCheckpoint(str(tmp_path))
    for e in range(E):
        ours = mxfp4.read_expert(ckpt, NAME, e, dtype)
        assert ours.shape == (ROWS, GROUPS * 32) and ours.dtype == dtype
        assert torch.equal(_bits(ours.t().contiguous()), _bits(theirs[e].contiguous())), e
        chunked = mxfp4.dequantize(blocks[e], scales[e], dtype, rows_per_chunk=3)
        assert torch.equal(_bits(chunked), _bits(ours))
    # The check can fail: swapping the nibbles (high first) gives other values.
    swapped = ((blocks << 4) | (blocks >> 4)).to(torch.uint8)
    assert not torch.equal(mxfp4.dequantize(swapped[1], scales[1], dtype).t(), theirs[1])


def test_bad_pairs_are_named():
    blocks, scales = _pair()
    with pytest.raises(ConversionError, match=r"w_blocks / w_scales: dtypes torch.int32"):
        mxfp4.check_pair("w", blocks.shape, scales.shape, torch.int32, torch.uint8, "/m")
    with pytest.raises(ConversionError, match=r"shapes \[3, 10, 4, 16\] / \[3, 10, 5\]"):
        mxfp4.check_pair("w", blocks.shape, (3, 10, 5), torch.uint8, torch.uint8, "/m")
    with pytest.raises(ConversionError, match="8 bytes per block"):
        mxfp4.dequantize(blocks[..., :8].contiguous(), scales)
