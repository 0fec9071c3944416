"""The full-width query/key RMSNorms (OLMoE): transformers' OlmoeRMSNorm at one rank; at TP2
(with and without SP) each rank's slice of the output, input gradient and weight gradient equals
the single-process norm over the global width; a per-rank norm (no all-reduce) does not; the
checkpoint shards the weight over TP on axis 0."""

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lora.models.qk_norm import FullWidthKeyNorm, FullWidthQueryNorm
from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank

N, G, D, EPS = 8, 4, 6, 1e-5  # query heads, key heads, head dim
CLASSES = {"query": (FullWidthQueryNorm, N), "key": (FullWidthKeyNorm, G)}


def _config(tp: int = 1, sp: bool = False, dtype=torch.float32) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=N * D, num_attention_heads=N,
                             num_query_groups=G, kv_channels=D, tensor_model_parallel_size=tp,
                             sequence_parallel=sp, params_dtype=dtype)


def _global_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The norm over the last dimension (the whole projection), fp32."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("which", ["query", "key"])
def test_one_rank_is_transformers_olmoe_norm(which, dtype):
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    cls, heads = CLASSES[which]
    torch.manual_seed(0)
    ours, theirs = cls(_config(dtype=dtype), D, eps=EPS), OlmoeRMSNorm(heads * D, eps=EPS)
    theirs.to(dtype)
    with torch.no_grad():
        theirs.weight.uniform_(0.5, 1.5)
        ours.weight.copy_(theirs.weight)
    x = torch.randn(5, 3, heads, D).to(dtype)
    out = ours(x)
    assert out.shape == x.shape and out.dtype == dtype
    # HF norms the [s, b, heads*d] projection before splitting it into heads
    torch.testing.assert_close(out, theirs(x.flatten(-2)).view(x.shape), rtol=1e-6, atol=1e-6)


def test_a_head_count_that_tp_does_not_divide_is_refused():
    with pytest.raises(ValueError, match="key heads=4 must divide by the tensor-parallel size 8"):
        FullWidthKeyNorm(_config(tp=8), D)


@pytest.mark.parametrize("which", ["query", "key"])
@pytest.mark.parametrize("layout", [ParallelLayout(tp=2), ParallelLayout(tp=2, sp=True)],
                         ids=["TP2", "TP2+SP"])
@multirank(world_size=2, timeout=180)
def test_tp2_slices_are_the_global_norm(layout, which):
    cls, heads = CLASSES[which]
    torch.manual_seed(0)  # the same global tensors on both ranks
    x = torch.randn(5, 3, heads, D)
    w = torch.empty(heads * D).uniform_(0.5, 1.5)
    grad_out = torch.randn(5, 3, heads * D)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = _global_norm(xg.flatten(-2), wg)
    (ref * grad_out).sum().backward()

    rank, local = parallel_state.get_tensor_model_parallel_rank(), heads // 2
    cols = slice(rank * local * D, (rank + 1) * local * D)
    norm = cls(_config(tp=2, sp=layout.sp), D, eps=EPS)
    assert norm.weight.shape == (local * D,)
    with torch.no_grad():
        norm.weight.copy_(w[cols])
    xl = x[:, :, rank * local:(rank + 1) * local].clone().requires_grad_()
    out = norm(xl)
    # Each rank back-propagates its own heads' part, as attention does with its local heads.
    (out.flatten(-2) * grad_out[..., cols]).sum().backward()
    torch.testing.assert_close(out.flatten(-2), ref[..., cols].detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xl.grad, xg.grad[:, :, rank * local:(rank + 1) * local],
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.weight.grad, wg.grad[cols], rtol=1e-5, atol=1e-6)

    # Without the all-reduce each rank would normalise over its own heads only: far off.
    per_rank = _global_norm(xl.detach().flatten(-2), w[cols])
    assert (per_rank - ref[..., cols]).abs().max().item() > 1e-2


@multirank(world_size=2, timeout=180)
def test_checkpoint_shards_the_weight_over_tp_on_axis_0(layout=ParallelLayout(tp=2, sp=True)):
    rank = parallel_state.get_tensor_model_parallel_rank()
    norm = FullWidthQueryNorm(_config(tp=2, sp=True), D)
    assert norm.weight.tensor_model_parallel and norm.weight.partition_dim == 0
    assert not getattr(norm.weight, "sequence_parallel", False)  # no TP sum of its gradient
    sharded = norm.sharded_state_dict(prefix="decoder.layers.self_attention.q_layernorm.",
                                      sharded_offsets=((0, 3, 4),))  # layer 3 of 4
    t = sharded["decoder.layers.self_attention.q_layernorm.weight"]
    assert tuple(t.global_shape) == (4, N * D)
    assert tuple(t.global_offset) == (3, rank * N // 2 * D)
    assert tuple(t.local_shape) == (N // 2 * D,)


def test_the_spec_builds_the_full_width_norms_only_when_asked():
    from megatron_lora.models.norm import RMSNorm
    from megatron_lora.models.specs import local_block_spec, local_layer_spec, with_qk_norms
    from megatron_lora.runtime.versions import spec_submodules

    def norms(layer):
        attention = spec_submodules(spec_submodules(layer).self_attention)
        return attention.q_layernorm, attention.k_layernorm

    assert norms(local_layer_spec(4, qk_layernorm=True, qk_norm_full_width=True)) == (
        FullWidthQueryNorm, FullWidthKeyNorm)
    per_head = local_layer_spec(4, qk_layernorm=True)
    assert norms(per_head) == (RMSNorm, RMSNorm)
    # what the Transformer Engine spec gets: its per-head norms swapped, the original kept
    assert norms(with_qk_norms(per_head, full_width=True)) == (FullWidthQueryNorm, FullWidthKeyNorm)
    assert norms(per_head) == (RMSNorm, RMSNorm)
    with pytest.raises(ValueError, match="qk_norm_full_width needs a config with qk_layernorm"):
        local_block_spec(_config(), pp_rank=0, qk_norm_full_width=True)
