"""GPT-OSS's MoE block in megatron-core against transformers' own GptOssMLP.

A tiny GptOssMLP made by transformers 5.24 (random weights, router and expert biases non-zero,
a `swiglu_limit` that the gate and the up projection both exceed) is loaded into megatron's
MoELayer built from `transformer_config` (ModelShape.add_bias_linear, swiglu_alpha /
swiglu_limit: router with a bias, top-k then softmax over the selected logits, biased experts,
the clamped SwiGLU with gate and up de-interleaved from HF's gate_up_proj) at EP2, with grouped
experts and with megatron's SequentialMLP, both dispatchers. Output and input gradient equal
transformers' (fp32), and every local expert's bias gradient equals transformers' (twice: both EP
ranks feed the same tokens); controls show the check sees a lost bias and a lost clamp.
With non-zero LoRA adapters on every expert linear, grouped and sequential experts agree.
Bounds: compare.reference_bound of each quantity, from the reference (transformers' block; with
LoRA, the sequential experts) evaluated again in fp64 on the same inputs (see _reference).
Expert-TP > 1 with biased experts is refused naming --expert-tensor-parallel-size.
"""

import pytest
import torch

from megatron_lora.families.shape import tiny_moe_shape
from megatron_lora.runtime import ParallelLayout
from megatron_lora.runtime.layout import LayoutError
from tests.harness import multirank

H, FFN, E, TOPK, LIMIT, ALPHA = 16, 24, 4, 2, 0.6, 1.702
# Bounds (issue 37): each compared quantity q is held to compare.reference_bound(q32, q64),
# (K + 1) x the reference's own fp32 rounding of q on these inputs, measured against the same
# reference run in fp64 (a .double() copy, the same inputs): ours is another fp32 order of the
# same real computation. This holds while routing does not depend on the order: each token's
# TOPK-th router logit is checked first to lie further above the next one than two such bounds
# of the logits (_check_routing_margin). A clamp whose input lies within rounding of LIMIT could
# still flip its derivative: none does on these inputs (the margin to LIMIT is checked too).


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


def _hf_values(hf, x, grad_out):
    """transformers' output and input gradient [s, b, h], router bias gradient [E] and the
    expert bias gradients in megatron's layout ([E, 2 FFN] fc1, [E, H] fc2), in hf's dtype."""
    out, x_grad = _run_hf(hf, x.to(hf.router.weight.dtype), grad_out.to(hf.router.weight.dtype))
    return {"output": out, "input gradient": x_grad, "router bias": hf.router.bias.grad,
            "linear_fc1": _fc1(hf.experts.gate_up_proj_bias.grad),
            "linear_fc2": hf.experts.down_proj_bias.grad}


def _reference(hf, x, grad_out):
    """(values, bounds): _hf_values in fp32 (hf's own .grad set) and each one's
    compare.reference_bound from a .double() copy of hf on the same inputs."""
    import copy

    from megatron_lora.testing.compare import reference_bound

    ref32 = _hf_values(hf, x, grad_out)
    ref64 = _hf_values(copy.deepcopy(hf).double(), x, grad_out)
    return ref32, {k: reference_bound(ref32[k], ref64[k]) for k in ref32}


def _check_routing_margin(hf, x):
    """Every token's TOPK-th router logit is further above the next than twice the logits'
    reference_bound (each order's logits are within it of the exact ones), and no expert's fc1
    output lies within twice its bound of +-LIMIT: megatron and transformers pick the same
    experts and clamp the same elements in every summation order."""
    import copy

    from megatron_lora.testing.compare import reference_bound

    tokens = x.reshape(-1, H)
    with torch.no_grad():
        l32 = tokens @ hf.router.weight.t() + hf.router.bias
        h64 = copy.deepcopy(hf).double()
        l64 = tokens.double() @ h64.router.weight.t() + h64.router.bias
    bound = reference_bound(l32, l64)
    top = l64.sort(dim=1, descending=True).values
    gap = top[:, TOPK - 1] - top[:, TOPK]
    token = int(gap.argmin())
    assert gap[token] > 2 * bound, (f"token {token}: top-{TOPK} router logit gap "
                                    f"{float(gap[token]):.3e} <= 2 x bound {bound:.3e}: routing "
                                    f"depends on summation order")
    with torch.no_grad():
        g32 = _fc1(tokens @ hf.experts.gate_up_proj + hf.experts.gate_up_proj_bias[:, None])
        g64 = _fc1(tokens.double() @ h64.experts.gate_up_proj
                   + h64.experts.gate_up_proj_bias[:, None])
    near = (g64.abs() - LIMIT).abs().min()
    assert near > 2 * reference_bound(g32, g64), f"an fc1 output within {float(near):.3e} of LIMIT"


def _check(got, want, bound, what):
    """|got - want| <= bound everywhere; else the worst element, its index and the bound."""
    from tests.lora._bounds import judge

    why = judge(got, want, bound, what)
    assert why is None, why


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
    from megatron_lora.testing.compare import reference_bound

    hf = _hf_mlp()
    x, grad_out = _inputs()
    _check_routing_margin(hf, x)
    want, bound = _reference(hf, x, grad_out)
    ref = want["output"]
    with torch.no_grad():  # the clamp is reached on both halves; controls see bias and clamp
        gate_up = x.reshape(-1, H) @ hf.experts.gate_up_proj[0] + hf.experts.gate_up_proj_bias[0]
        assert (gate_up[:, 0::2] > LIMIT).any() and (gate_up[:, 1::2].abs() > LIMIT).any()
        unbiased = _hf_mlp()
        unbiased.experts.down_proj_bias.zero_()
    no_clamp = _run_hf(_hf_mlp(limit=1e9), x, grad_out)[0]
    unbiased = _run_hf(unbiased, x, grad_out)[0]
    assert (no_clamp - ref).abs().max() > 1e-2 and (unbiased - ref).abs().max() > 1e-2

    outputs = {}
    for dispatcher in ("alltoall", "allgather"):
        for grouped in (True, False):
            layer = _layer(layout, dispatcher, grouped, hf)
            assert (type(layer.experts) is GroupedExperts) == grouped
            out, x_grad = _run(layer, x, grad_out)
            case = f"{dispatcher}/{'grouped' if grouped else 'sequential'}"
            _check(out, ref, bound["output"], f"{case} output")
            _check(x_grad, want["input gradient"], bound["input gradient"],
                   f"{case} input gradient")
            experts = layer.experts
            for local, mlp in enumerate(experts.local_experts):
                e = experts.ep_group.rank() * experts.num_local_experts + local
                for name in ("linear_fc1", "linear_fc2"):
                    # twice transformers' (doubling is exact): the bound of the whole tensor, x 2
                    _check(getattr(mlp, name).bias.grad, 2 * want[name][e], 2 * bound[name],
                           f"{case} expert {e} {name} bias gradient")
            _check(layer.router.bias.grad, want["router bias"], bound["router bias"],
                   f"{case} router bias gradient")
        # LoRA (non-zero B) on every expert linear: grouped equals sequential experts, the
        # reference here (megatron's SequentialMLP with LoRA, run again in fp64 for the bounds).
        for grouped, dtype in ((True, torch.float32), (False, torch.float32),
                               (False, torch.float64)):
            layer = _layer(layout, dispatcher, grouped, hf)
            adapters = wrap_experts(layer.experts, AdapterConfig(rank=4, alpha=8,
                                                                 init_lora_weights=False),
                                    prefix="decoder.layers.0.mlp.experts", seed_for=len,
                                    moe_layer=layer)
            layer.to(dtype)
            out, x_grad = _run(layer, x.to(dtype), grad_out.to(dtype))
            outputs[grouped, dtype] = [out, x_grad] + [a.lora_B.grad for a in adapters]
        ours, seq, seq64 = (outputs[True, torch.float32], outputs[False, torch.float32],
                            outputs[False, torch.float64])
        assert (ours[0] - ref).abs().max() > 1e-3  # the adapters change the output
        names = ["output", "input gradient"] + [f"lora_B gradient {i}"
                                                for i in range(len(ours) - 2)]
        for what, a, b, b64 in zip(names, ours, seq, seq64):
            _check(a, b, reference_bound(b, b64),
                   f"{dispatcher} LoRA grouped vs sequential {what}")


def test_expert_tp_with_biased_experts_is_refused():
    sizes = _shape().layout_sizes()
    with pytest.raises(LayoutError, match="experts with biases need --expert-tensor-parallel-size "
                                          "1, got 2 \\(it defaults to the tensor-parallel size\\)"):
        ParallelLayout(tp=2, sp=True).validate(2, flags=True, **sizes)
    ParallelLayout(tp=2, sp=True, etp=1).validate(2, flags=True, **sizes)
    ParallelLayout(tp=2, sp=True).validate(2, flags=True, **tiny_moe_shape().layout_sizes())
