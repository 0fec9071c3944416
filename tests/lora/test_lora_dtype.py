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
from megatron_lora.testing import compare
from megatron_lora.testing.compare import assert_within, unit_roundoff
from tests.harness import multirank



def _bound(want: torch.Tensor, want64: torch.Tensor) -> float:
    """compare.reference_bound in the compared quantity's own dtype: (K + 1) x the plain-torch
    reference's own rounding of it (the same casts: bf16 activations or factor gradients cast
    back to bf16), measured against the same reference in fp64, and at least (K + 1) roundings
    of its largest element (u = 2**-8 for bf16, 2**-24 for fp32). The adapter is another order
    of the same real computation with the same casts; the argument (compare's docstring) holds
    for any unit roundoff. Where the result is rounded to bf16 last, two nearby values may round
    one step (2 u |value|) apart, which the floor covers."""
    r, r64 = want.detach().double(), want64.detach().double()
    own = float((r - r64).abs().max()) if r.numel() else 0.0
    return (compare.K_ORDERS + 1) * max(own, unit_roundoff(want.dtype) * float(r64.abs().max()))


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
    x2_shape = (-1, x.shape[-1])
    mask = keep_mask(key, p, 0, x.reshape(x2_shape).shape[0], 0, x.shape[-1])

    def reference(x, w, a, b, gy, dtype):
        """(output, input, A and B gradients) of plain torch in `dtype` activations."""
        xr, ar, br = (t.detach().clone().requires_grad_(True) for t in (x, a, b))
        x2 = xr.reshape(x2_shape)
        u = (x2 * mask.to(dtype) * (1.0 / (1.0 - p))) @ ar.to(dtype).t() * scale
        yr = (x2 @ w.to(dtype).t() + u @ br.to(dtype).t()).reshape(out.shape)
        (yr * gy.to(dtype)).sum().backward()
        return yr.detach(), xr.grad, ar.grad, br.grad

    w = base.weight.detach()
    want = reference(x, w, A, B, gy, base_dtype)
    assert want[2].dtype == want[3].dtype == torch.bfloat16
    want64 = reference(*(t.detach().double() for t in (x, w, A, B, gy)), torch.float64)
    got = (out, x.grad, A.grad, B.grad)
    for i, what in enumerate(("output", "input gradient", "A gradient", "B gradient")):
        if i >= 2:
            assert got[i].dtype == torch.bfloat16
        assert_within(got[i], want[i], _bound(want[i], want64[i]),
                      f"dense {base_dtype} {what}")


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

        def reference(x, a, b, gy, dtype):
            """(output, input, A and B gradients) of a per-expert plain-torch loop."""
            xr, ar, br = (t.detach().clone().requires_grad_(True) for t in (x, a, b))
            parts, start = [], 0
            for e, n in enumerate(counts):
                xe = xr[start:start + n]
                parts.append((xe @ ar[e].to(dtype).t() * lora.scales[e]) @ br[e].to(dtype).t())
                start += n
            yr = torch.cat(parts)
            (yr * gy.to(dtype)).sum().backward()
            return yr.detach(), xr.grad, ar.grad, br.grad

        want = reference(x, lora.lora_A, lora.lora_B, gy, act_dtype)
        want64 = reference(*(t.detach().double() for t in (x, lora.lora_A, lora.lora_B, gy)),
                           torch.float64)
        got = (y, x.grad, lora.lora_A.grad, lora.lora_B.grad)
        for k, what in enumerate(("output", "input gradient", "A gradient", "B gradient")):
            if k >= 2:
                assert got[k].dtype == torch.bfloat16
            assert_within(got[k], want[k], _bound(want[k], want64[k]),
                          f"{kind} {act_dtype} {what}")
        assert lora.lora_A.grad[1].abs().max() == 0  # the expert with no token
