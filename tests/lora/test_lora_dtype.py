"""Half-precision adapters (LoraConfig.dtype, train --lora-dtype): the config, and one dense and
one expert adapter in bf16 against plain torch computed with the same casts.

The casts (lora/projection.py, lora/grouped.py): the factors are held in the adapter dtype; the
LoRA matmuls run in the activation dtype with the factor cast to it; the factor gradients are
cast back to the factor dtype; the output is in the base output's dtype.
"""

import pytest
import torch

from megatron_lora.lora.config import AdapterConfig
from megatron_lora.lora.model import LoraConfig, dtype_name
from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank

# bf16 has an 8-bit significand: one ulp is 2**-7 relative to the value (0.78 %).
BF16_RTOL = 2 ** -7


@pytest.mark.parametrize("name,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                        ("fp16", torch.float16), ("bfloat16", torch.bfloat16),
                                        (torch.float16, torch.float16), (None, None)])
def test_config_names_and_round_trip(name, dtype):
    from megatron_lora.export.adapter_ckpt import lora_config_from_dict

    config = LoraConfig(dtype=name)
    assert config.dtype == dtype
    assert config.adapter_config("decoder.layers.0.self_attention.linear_qkv").dtype == dtype
    assert lora_config_from_dict(config.to_dict()) == config
    if dtype is not None:
        assert LoraConfig(dtype=dtype_name(dtype)).dtype == dtype


@pytest.mark.parametrize("bad", ["fp8", "float64", torch.float64, torch.int8, 16])
def test_config_refuses_other_dtypes_naming_field_and_flag(bad):
    with pytest.raises(ValueError, match=r"LoraConfig\.dtype \(--lora-dtype\) must be fp32, bf16 "
                                         r"or fp16"):
        LoraConfig(dtype=bad)


def test_cli_flag_refuses_other_dtypes(capsys):
    from megatron_lora.cli import train as train_cli

    parser = train_cli.parser()
    action = next(a for a in parser._actions if "--lora-dtype" in a.option_strings)
    assert action.default == "fp32" and tuple(action.choices) == ("fp32", "bf16", "fp16")
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora-dtype", "fp8"])
    assert "--lora-dtype" in capsys.readouterr().err


@pytest.mark.parametrize("base_dtype", [torch.float32, torch.bfloat16], ids=["fp32base",
                                                                            "bf16base"])
@pytest.mark.parametrize("layout", [ParallelLayout()], ids=["TP1"])
@multirank(world_size=1, timeout=120)
def test_dense_bf16_adapter_matches_plain_torch(base_dtype, layout):
    """A column-parallel adapter, bf16 factors (non-zero B), dropout 0.25: output and input /
    factor gradients against plain torch with the same casts and the same dropout mask."""
    from megatron_lora.lora import LoraAdapter, draw_dropout_key, keep_mask
    from tests.lora._support import Case, build, global_batch

    p, scale = 0.25, 8.0 / 4
    _, base, _ = build(Case("column", bias=False), 1, dtype=base_dtype)
    adapter = LoraAdapter(base, AdapterConfig(rank=4, alpha=8.0, dropout=p,
                                              init_lora_weights=False, dtype=torch.bfloat16),
                          seed=11)
    A, B = adapter.lora_A, adapter.lora_B
    assert A.dtype == B.dtype == torch.bfloat16 and base.weight.dtype == base_dtype
    assert B.abs().max() > 0
    x = global_batch()[0].to(base_dtype).requires_grad_(True)  # [s, b, in]
    gy = torch.randn(x.shape[0], x.shape[1], base.weight.shape[0],
                     generator=torch.Generator().manual_seed(1)).to(base_dtype)
    adapter.train()
    rng = torch.get_rng_state()
    out, _ = adapter(x)
    after = torch.get_rng_state()
    torch.set_rng_state(rng)
    key = draw_dropout_key(torch.device("cpu"))
    torch.set_rng_state(after)
    assert out.dtype == base_dtype  # the base output's dtype
    (out * gy).sum().backward()

    # plain torch, the same casts: factors to the activation dtype, grads back to bf16
    xr = x.detach().clone().requires_grad_(True)
    ar = A.detach().clone().requires_grad_(True)
    br = B.detach().clone().requires_grad_(True)
    x2 = xr.reshape(-1, xr.shape[-1])
    mask = keep_mask(key, p, 0, x2.shape[0], 0, x2.shape[1]).to(base_dtype)
    u = (x2 * mask * (1.0 / (1.0 - p))) @ ar.to(base_dtype).t() * scale
    w = base.weight.detach()
    yr = (x2 @ w.t() + u @ br.to(base_dtype).t()).reshape(out.shape)
    (yr * gy).sum().backward()
    assert ar.grad.dtype == br.grad.dtype == torch.bfloat16
    tol = dict(rtol=0, atol=1e-5) if base_dtype == torch.float32 else dict(rtol=4 * BF16_RTOL,
                                                                         atol=2e-2)
    torch.testing.assert_close(out, yr, **tol)
    torch.testing.assert_close(x.grad, xr.grad, **tol)
    # bf16 factor gradients: the fp32 (or bf16) values rounded to bf16; at most one ulp apart
    for got, want in ((A.grad, ar.grad), (B.grad, br.grad)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * BF16_RTOL, atol=1e-3)


@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16], ids=["fp32act",
                                                                          "bf16act"])
@pytest.mark.parametrize("layout", [ParallelLayout()], ids=["TP1"])
@multirank(world_size=1, timeout=120)
def test_expert_bf16_adapter_matches_plain_torch(act_dtype, layout):
    """Stacked expert adapters (4 experts, one with no token), bf16 factors: fc1 and fc2 outputs
    and gradients of the grouped path against a per-expert plain-torch loop with the same
    casts."""
    from megatron.core import parallel_state as ps

    from tests.lora.test_grouped import expert_bases, stacked_lora

    counts = [3, 0, 5, 2]
    cfg = AdapterConfig(rank=4, alpha=8.0, init_lora_weights=False, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    group = ps.get_expert_tensor_parallel_group()
    for kind, (i, o) in (("linear_fc1", (16, 48)), ("linear_fc2", (24, 16))):
        lora = stacked_lora(kind, expert_bases(kind, 4, group, i, o), cfg, [5, 6, 7, 8])
        assert lora.lora_A.dtype == lora.lora_B.dtype == torch.bfloat16
        x = torch.randn(sum(counts), i, generator=g).to(act_dtype).requires_grad_(True)
        gy = torch.randn(sum(counts), o, generator=g).to(act_dtype)
        y = lora.grouped(x, counts)
        assert y.dtype == act_dtype
        (y * gy).sum().backward()
        xr = x.detach().clone().requires_grad_(True)
        ar = lora.lora_A.detach().clone().requires_grad_(True)
        br = lora.lora_B.detach().clone().requires_grad_(True)
        parts, start = [], 0
        for e, n in enumerate(counts):
            xe = xr[start:start + n]
            parts.append((xe @ ar[e].to(act_dtype).t() * lora.scales[e]) @ br[e].to(act_dtype).t())
            start += n
        yr = torch.cat(parts)
        (yr * gy).sum().backward()
        exact = act_dtype == torch.float32
        tol = dict(rtol=0, atol=1e-5) if exact else dict(rtol=4 * BF16_RTOL, atol=2e-2)
        torch.testing.assert_close(y, yr, **tol)
        torch.testing.assert_close(x.grad, xr.grad, **tol)
        for got, want in ((lora.lora_A.grad, ar.grad), (lora.lora_B.grad, br.grad)):
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.float(), want.float(), rtol=2 * BF16_RTOL, atol=1e-3)
        assert lora.lora_A.grad[1].abs().max() == 0  # the expert with no token
