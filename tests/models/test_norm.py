"""RMSNorm for local specs: the Hugging Face Mixtral formula, and marked for SP gradient sums."""

import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lora.models.norm import RMSNorm
from megatron_lora.testing.compare import assert_within


def _config(sp: bool, dtype=torch.float32):
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, sequence_parallel=sp,
                             tensor_model_parallel_size=2 if sp else 1, params_dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_mixtral_formula(dtype):
    norm = RMSNorm(_config(False, dtype), 8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
    x = torch.randn(3, 2, 8).to(dtype)
    h = x.float()
    expected = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    out = norm(x)
    assert out.dtype == dtype
    # Exact: `expected` is models/norm.py's own sequence of ops (fp32 cast, square, mean over
    # the last dim, + eps, rsqrt, product, cast back, weight product) on the same tensors and
    # device, so each rounding is the same; a changed formula (eps, mean, cast order) is not
    assert_within(out, expected, 0.0, f"RMSNorm {dtype}")


@pytest.mark.parametrize("sp", [False, True])
def test_weight_is_marked_for_the_tp_gradient_sum_under_sp(sp):
    assert RMSNorm(_config(sp), 8).weight.sequence_parallel is sp


def test_rejects_layernorm():
    with pytest.raises(ValueError, match="normalization='LayerNorm'"):
        RMSNorm(_config(False), 8, normalization="LayerNorm")
