"""The full-width query/key RMSNorms (OLMoE): transformers' OlmoeRMSNorm at one rank; at TP2
(with and without SP) each rank's slice of the output, input gradient and weight gradient equals
the single-process norm over the global width; a per-rank norm (no all-reduce) does not; the
checkpoint shards the weight over TP on axis 0."""

import copy

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lora.models.qk_norm import FullWidthKeyNorm, FullWidthQueryNorm
from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing.compare import assert_within, reference_bound, unit_roundoff
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
    want = theirs(x.flatten(-2)).view(x.shape)
    if dtype == torch.float32:
        # compare.reference_bound: OlmoeRMSNorm again in fp64 on the same inputs (it keeps its
        # fp32 normalisation there: K covers that, see compare's docstring); ours sums the
        # squares and divides by the width where HF takes the mean: another fp32 order
        theirs64 = copy.deepcopy(theirs).double()
        bound = reference_bound(want, theirs64(x.double().flatten(-2)).view(x.shape))
    else:
        # Both compute h = x * rsqrt(mean x^2 + eps) in fp32 (within fp32 rounding of each other)
        # and return bf16(weight * bf16(h)): each of the two bf16 roundings can land one step
        # apart, a step being at most 2 u |value| (u = 2**-8), so the outputs differ by at most
        # 2 u |w h| + 2 u |out| <= 4 u (1 + 2 u) |expected| per element (the fp32 difference
        # itself is 2**-16 of that)
        u = unit_roundoff(torch.bfloat16)
        bound = 4 * u * (1 + 2 * u) * want.double().abs() * (1 + 2 ** -16)
    assert_within(out, want, bound, f"{which} norm {dtype} vs OlmoeRMSNorm")


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
    # the plain-torch reference in fp32 (compared) and fp64 (its rounding: the bounds)
    refs = []
    for dtype in (torch.float32, torch.float64):
        xg, wg = (t.detach().to(dtype).clone().requires_grad_() for t in (x, w))
        ref = _global_norm(xg.flatten(-2), wg)
        (ref * grad_out.to(dtype)).sum().backward()
        refs.append((ref.detach(), xg.grad, wg.grad))
    (ref, x_ref, w_ref), (ref64, x_ref64, w_ref64) = refs

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
    # compare.reference_bound of each whole quantity: ours sums the squares per rank and
    # all-reduces the partial sums, another fp32 order of the same computation
    heads_here = slice(rank * local, (rank + 1) * local)
    assert_within(out.flatten(-2), ref[..., cols], reference_bound(ref, ref64), "output")
    assert_within(xl.grad, x_ref[:, :, heads_here], reference_bound(x_ref, x_ref64),
                  "input gradient")
    assert_within(norm.weight.grad, w_ref[cols], reference_bound(w_ref, w_ref64),
                  "weight gradient")

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
