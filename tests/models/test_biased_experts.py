"""GPT-OSS's MoE block in megatron-core against transformers' own GptOssMLP.

A tiny GptOssMLP made by transformers 5.24 (random weights, router and expert biases non-zero,
a `swiglu_limit` that the gate and the up projection both exceed) is loaded into megatron's
MoELayer built from `transformer_config` (ModelShape.add_bias_linear, swiglu_alpha /
swiglu_limit: router with a bias, top-k then softmax over the selected logits, biased experts,
the clamped SwiGLU with gate and up de-interleaved from HF's gate_up_proj) at EP2, with grouped
experts and with megatron's SequentialMLP, both dispatchers. Output and input gradient equal
transformers' (fp32, 1e-5), and every local expert's bias gradient equals transformers' (twice:
both EP ranks feed the same tokens); controls show the check sees a lost bias and a lost clamp.
With non-zero LoRA adapters on every expert linear, grouped and sequential experts agree.
Expert-TP > 1 with biased experts is refused naming --expert-tensor-parallel-size.
"""

import pytest
import torch

from megatron_lora.families.shape import tiny_moe_shape
from megatron_lora.runtime import ParallelLayout
from megatron_lora.runtime.layout import LayoutError
from tests.harness import multirank

H, FFN, E, TOPK, LIMIT, ALPHA = 16, 24, 4, 2, 0.6, 1.702
ATOL = 1e-5


def _hf_mlp(limit=LIMIT):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    config = GptOssConfig(hidden_size=H, intermediate_size=FFN, num_local_experts=E,
                          num_experts_per_tok=TOPK, swiglu_limit=limit)
    config._experts_implementation = "eager"
    torch.manual_seed(11)
    mlp = GptOssMLP(config)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return mlp


def _shape():
    return tiny_moe_shape(hidden_size=H, ffn_hidden_size=FFN, num_experts=E, moe_router_topk=TOPK,
                          num_layers=1, num_attention_heads=4, num_query_groups=2,
                          add_bias_linear=True, swiglu_alpha=ALPHA, swiglu_limit=LIMIT)


def _fc1(gate_up: torch.Tensor) -> torch.Tensor:
    """HF's interleaved [..., 2f] (gate, up, gate, up, ...) -> megatron's [gate; up] rows."""
    return torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1)


def _layer(layout, dispatcher, grouped, hf):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_lora.models.gpt import transformer_config
    from megatron_lora.models.specs import local_layer_spec
    from megatron_lora.runtime.versions import spec_submodules

    config = transformer_config(_shape(), layout, dispatcher=dispatcher)
    spec = spec_submodules(local_layer_spec(E, moe_grouped_gemm=grouped)).mlp
    layer = MoELayer(config, submodules=spec_submodules(spec), layer_number=1)
    layer.set_layer_number(1)
    experts = layer.experts
    with torch.no_grad():
        layer.router.weight.copy_(hf.router.weight)
        layer.router.bias.copy_(hf.router.bias)
        for local, mlp in enumerate(experts.local_experts):
            e = experts.ep_group.rank() * experts.num_local_experts + local
            mlp.linear_fc1.weight.copy_(_fc1(hf.experts.gate_up_proj[e]).t())
            mlp.linear_fc1.bias.copy_(_fc1(hf.experts.gate_up_proj_bias[e]))
            mlp.linear_fc2.weight.copy_(hf.experts.down_proj[e].t())
            mlp.linear_fc2.bias.copy_(hf.experts.down_proj_bias[e])
    return layer


def _inputs():
    g = torch.Generator().manual_seed(13)
    return torch.randn(6, 2, H, generator=g), torch.randn(6, 2, H, generator=g) * 0.1


def _run_hf(hf, x, grad_out):
    hf.zero_grad()
    x = x.clone().requires_grad_(True)
    out, _ = hf(x.transpose(0, 1))
    out = out.transpose(0, 1)
    (out * grad_out).sum().backward()
    return out.detach(), x.grad


def _run(layer, x, grad_out):
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * grad_out).sum().backward()
    return out.detach(), x.grad


@multirank(world_size=2, timeout=300)
def test_gpt_oss_moe_block_matches_transformers_at_ep2(layout=ParallelLayout(ep=2)):
    from megatron_lora.lora import AdapterConfig
    from megatron_lora.lora.experts import wrap_experts
    from megatron_lora.models.grouped_experts import GroupedExperts

    hf = _hf_mlp()
    x, grad_out = _inputs()
    ref, ref_grad = _run_hf(hf, x, grad_out)
    with torch.no_grad():  # the clamp is reached on both halves; controls see bias and clamp
        gate_up = x.reshape(-1, H) @ hf.experts.gate_up_proj[0] + hf.experts.gate_up_proj_bias[0]
        assert (gate_up[:, 0::2] > LIMIT).any() and (gate_up[:, 1::2].abs() > LIMIT).any()
        unbiased = _hf_mlp()
        unbiased.experts.down_proj_bias.zero_()
    no_clamp = _run_hf(_hf_mlp(limit=1e9), x, grad_out)[0]
    unbiased = _run_hf(unbiased, x, grad_out)[0]
    assert (no_clamp - ref).abs().max() > 1e-2 and (unbiased - ref).abs().max() > 1e-2
    hf_bias = {"linear_fc1": _fc1(hf.experts.gate_up_proj_bias.grad),
               "linear_fc2": hf.experts.down_proj_bias.grad}

    outputs = {}
    for dispatcher in ("alltoall", "allgather"):
        for grouped in (True, False):
            layer = _layer(layout, dispatcher, grouped, hf)
            assert (type(layer.experts) is GroupedExperts) == grouped
            out, x_grad = _run(layer, x, grad_out)
            case = f"{dispatcher}/{'grouped' if grouped else 'sequential'}"
            torch.testing.assert_close(out, ref, rtol=0, atol=ATOL, msg=case)
            torch.testing.assert_close(x_grad, ref_grad, rtol=0, atol=ATOL, msg=case)
            experts = layer.experts
            for local, mlp in enumerate(experts.local_experts):
                e = experts.ep_group.rank() * experts.num_local_experts + local
                for name, want in hf_bias.items():
                    got = getattr(mlp, name).bias.grad
                    torch.testing.assert_close(got, 2 * want[e], rtol=0, atol=ATOL,
                                               msg=f"{case} expert {e} {name}")
            torch.testing.assert_close(layer.router.bias.grad, hf.router.bias.grad, rtol=0,
                                       atol=ATOL, msg=case)
        # LoRA (non-zero B) on every expert linear: grouped equals sequential experts.
        for grouped in (True, False):
            layer = _layer(layout, dispatcher, grouped, hf)
            adapters = wrap_experts(layer.experts, AdapterConfig(rank=4, alpha=8,
                                                                 init_lora_weights=False),
                                    prefix="decoder.layers.0.mlp.experts", seed_for=len,
                                    moe_layer=layer)
            out, x_grad = _run(layer, x, grad_out)
            outputs[grouped] = (out, x_grad, [a.lora_B.grad for a in adapters])
        (g_out, g_x, g_b), (s_out, s_x, s_b) = outputs[True], outputs[False]
        assert (g_out - ref).abs().max() > 1e-3  # the adapters change the output
        torch.testing.assert_close(g_out, s_out, rtol=0, atol=ATOL)
        torch.testing.assert_close(g_x, s_x, rtol=0, atol=ATOL)
        for a, b in zip(g_b, s_b):
            torch.testing.assert_close(a, b, rtol=0, atol=ATOL)


def test_expert_tp_with_biased_experts_is_refused():
    sizes = _shape().layout_sizes()
    with pytest.raises(LayoutError, match="experts with biases need --expert-tensor-parallel-size "
                                          "1, got 2 \\(it defaults to the tensor-parallel size\\)"):
        ParallelLayout(tp=2, sp=True).validate(2, flags=True, **sizes)
    ParallelLayout(tp=2, sp=True, etp=1).validate(2, flags=True, **sizes)
    ParallelLayout(tp=2, sp=True).validate(2, flags=True, **tiny_moe_shape().layout_sizes())
