"""Grouped experts with an NF4 base (models/nf4_linear.py grouped_nf4): one expert dequantised at
a time and its rows' GEMM run from it, in forward and again in backward. The values are those of
the former stacked computation (all experts' weights stacked, then one grouped matmul) bit for
bit, and what the call holds at once stays under one expert's dequantisation, not a stack."""

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("bitsandbytes")

from benchmarks.qlora_memory import LiveBytes  # noqa: E402
from megatron_lora.lora.grouped import grouped_mm  # noqa: E402
from megatron_lora.models import nf4 as N  # noqa: E402
from megatron_lora.models.nf4_linear import dequantized, grouped_nf4  # noqa: E402


def _experts(num, out_features, in_features, seed=0):
    """num stand-ins for NF4 expert linears (what grouped_nf4 reads of them: the buffers)."""
    g = torch.Generator().manual_seed(seed)
    modules = []
    for _ in range(num):
        s = N.quantize_parts(torch.randn(out_features, in_features, generator=g) * 0.05)
        modules.append(SimpleNamespace(nf4_codes=s.codes, nf4_qabsmax=s.qabsmax,
                                       nf4_scale2=s.scale2, nf4_offsets=s.offsets,
                                       nf4_layout=s.layout))
    return modules


def _stacked_reference(x, grad, counts, modules):
    """The former computation: every expert's weight dequantised and stacked [E, out, in]."""
    w = torch.stack([dequantized(m, x.dtype) for m in modules])
    return grouped_mm(x, w.transpose(1, 2), counts), grouped_mm(grad, w, counts)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("counts", [[5, 0, 9, 2], [0, 0, 0, 0], [0, 16, 0, 0]], ids=str)
def test_grouped_nf4_is_the_stacked_computation_bit_for_bit(counts, dtype):
    modules = _experts(len(counts), 96, 128)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), 128, generator=g).to(dtype).requires_grad_(True)
    grad = torch.randn(sum(counts), 96, generator=g).to(dtype)
    y = grouped_nf4(x, counts, modules)
    y.backward(grad)
    ref_y, ref_grad_x = _stacked_reference(x.detach(), grad, counts, modules)
    assert y.dtype == dtype and y.shape == (sum(counts), 96)
    assert torch.equal(y, ref_y), (y - ref_y).abs().max()
    assert torch.equal(x.grad, ref_grad_x), (x.grad - ref_grad_x).abs().max()


def test_grouped_nf4_holds_one_expert_at_a_time():
    """Forward and backward over 8 experts [m, k] = [512, 256] in bf16 with few rows: what the
    call creates and holds at once. One expert's plain-torch dequantisation holds at most its
    int64 codes (4 m k bytes) or its fp32 product, with the fp32 values (4 m k), then the bf16
    result (2 m k) next to the previous expert's (2 m k): < 12 m k, plus the activations (x, y,
    grad, grad_x: [64, m + k] each way). The stacked computation held every expert's bf16 weight
    and their stack: 2 x 8 x 2 m k = 32 m k."""
    experts, m, k, rows = 8, 512, 256, 64
    modules = _experts(experts, m, k)
    counts = [rows // experts] * experts
    g = torch.Generator().manual_seed(2)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16).requires_grad_(True)
    grad = torch.randn(rows, m, generator=g).to(torch.bfloat16)
    activations = 2 * rows * (m + k) * 2  # y and grad_x, x and grad (bf16)
    bound = 12 * m * k + activations
    with LiveBytes() as mode:
        grouped_nf4(x, counts, modules).backward(grad)
    assert x.grad is not None
    assert mode.peak <= bound, (f"peak {mode.peak} bytes at {mode.peak_op} > bound {bound} "
                                f"(one expert's bf16 weight: {2 * m * k})")
    assert mode.peak >= 2 * m * k  # the measurement sees at least one dequantised weight


def test_live_bytes_counts_what_is_alive():
    """LiveBytes itself: new storages count while alive, views and inputs' storages do not."""
    a = torch.ones(1000)
    with LiveBytes() as mode:
        b = a * 2  # 4000 new bytes
        c = b.view(10, 100)  # a view: nothing new
        d = torch.ones(500) + 1  # ones (2000) and the sum (2000) next to b: the peak
        del b, c
        e = a + 1  # b's 4000 and the ones freed, e's 4000 arrive
    assert mode.peak == 4000 + 2000 + 2000, mode.peak
    assert mode.live == 2000 + 4000, mode.live
    assert d.numel() + e.numel() == 1500
