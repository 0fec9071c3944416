"""SDPAttention with GPT-OSS's learned sinks and sliding windows against transformers' own.

The reference is transformers 5.24's `eager_attention_forward` for gpt_oss (the sink as an
extra softmax column, scores materialised) with the masks transformers makes for GPT-OSS
(`create_causal_mask` / `create_sliding_window_causal_mask`, packed samples found from
position_ids that restart per sample). Compared in fp64, ours and theirs both (the comparison
then does not depend on either's summation order; ATOL below says why it holds); forward and
the gradients of q, k, v and the sinks agree to ATOL. Controls show that each check sees a
missing sink, a missing window and a packed-sample leak. A TP2 world checks that each rank's
sinks are its heads' slice and are checkpointed as megatron's DotProductAttention's
`softmax_offset` (global [heads], axis 0).
"""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import GptOssConfig
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from megatron_lora.data.packing import inputs_labels_mask
from megatron_lora.models.attention import SDPAttention
from megatron_lora.runtime import ParallelLayout
from megatron_lora.testing import compare
from tests.harness import multirank

HEADS, GROUPS, DIM, WINDOW = 4, 2, 8, 5
DTYPE = torch.float64
# Every compared element (outputs, gradients of q, k, v and the sinks) is a sum of at most
# 2 x 16 x 16 terms (2 heads per group x 16 queries x 16 keys and the sink) whose absolute
# values add up to well under 1e5 (inputs N(0, 1) under 6 in size, probabilities <= 1,
# |dP| <= 8 x 6 x 6, scale 1/sqrt(8)): two orders differ by at most 2 x 512 x 2**-53 x 1e5
# = 1.1e-8 (compare.sum_rounding_bound). In fp32 the same bound is 6: too loose to see
# anything, and a measured 1e-6 failed on another machine. A missing sink, window or
# packed-sample boundary moves the output by > 0.05 (the controls).
ATOL = compare.sum_rounding_bound(DTYPE, terms=2 * 16 * 16, abs_sum=1e5)


def _config(softmax_type="learnable", window=WINDOW, **kw):
    return TransformerConfig(
        num_layers=2, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
        num_query_groups=GROUPS, kv_channels=DIM, softmax_type=softmax_type, attention_dropout=0.0,
        params_dtype=kw.pop("params_dtype", DTYPE),
        window_size=None if window is None else (window - 1, 0), window_attn_skip_freq=2, **kw)


def _attention(layer_number=1, tp=1, **kw):
    """Layer 1 is windowed (window_attn_skip_freq=2: layers 1, 3, ...), layer 2 is full."""
    group = SimpleNamespace(size=lambda: tp)
    return SDPAttention(_config(**kw), layer_number, AttnMaskType.causal, "self",
                        pg_collection=SimpleNamespace(tp=group))


def _qkv(b, s, seed=0, dtype=DTYPE):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, HEADS, DIM, generator=g, dtype=dtype)
    k = torch.randn(s, b, GROUPS, DIM, generator=g, dtype=dtype)
    v = torch.randn(s, b, GROUPS, DIM, generator=g, dtype=dtype)
    return q, k, v


def _sinks(n=HEADS):
    return torch.tensor([1.5, -0.7, 0.3, 2.2][:n], dtype=DTYPE)


def _hf_mask(b, s, window, position_ids):
    config = GptOssConfig(num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=DIM,
                          hidden_size=HEADS * DIM, sliding_window=window)
    config._attn_implementation = "eager"
    make = create_causal_mask if window is None else create_sliding_window_causal_mask
    return make(config=config, inputs_embeds=torch.zeros(b, s, HEADS * DIM, dtype=DTYPE),
                attention_mask=None, cache=None, position_ids=position_ids,
                allow_is_causal_skip=False)


def _hf(q, k, v, sinks, window, position_ids=None):
    """transformers' eager GPT-OSS attention on megatron's [s, b, n, d] layout -> [s, b, n*d]."""
    s, b = q.shape[:2]
    if position_ids is None:
        position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=HEADS // GROUPS, training=False)
    out, _ = eager_attention_forward(
        module, *(t.permute(1, 2, 0, 3) for t in (q, k, v)), _hf_mask(b, s, window, position_ids),
        scaling=DIM ** -0.5)
    return out.transpose(0, 1).reshape(s, b, -1)


def _ours(attention, q, k, v, mask=None):
    return attention(q, k, v, mask)


def _leaves(*tensors):
    return [t.clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize("layer_number,window", [(1, WINDOW), (2, None)], ids=["sliding", "full"])
def test_sinks_and_window_match_transformers_forward_and_backward(layer_number, window):
    b, s = 2, 12
    attention = _attention(layer_number)
    assert attention.window == (None if window is None else window - 1)
    with torch.no_grad():
        attention.softmax_offset.copy_(_sinks())
    q, k, v = _qkv(b, s)
    grad_out = torch.randn(s, b, HEADS * DIM, generator=torch.Generator().manual_seed(3),
                           dtype=DTYPE)

    ours = _leaves(q, k, v)
    out = _ours(attention, *ours)
    out.backward(grad_out)
    theirs = _leaves(q, k, v, _sinks())
    ref = _hf(*theirs[:3], theirs[3], window)
    ref.backward(grad_out)

    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    for name, a, r in zip("qkv", ours, theirs):
        torch.testing.assert_close(a.grad, r.grad, rtol=0, atol=ATOL, msg=name)
    torch.testing.assert_close(attention.softmax_offset.grad, theirs[3].grad, rtol=0, atol=ATOL)
    assert theirs[3].grad.abs().min() > 1e-3  # the sinks do get a gradient

    with torch.no_grad():  # controls: without the sinks, or with the other layer kind
        no_sink = _hf(q, k, v, torch.full((HEADS,), -1e4, dtype=DTYPE), window)
        other = _hf(q, k, v, _sinks(), None if window else WINDOW)
    assert (out - no_sink).abs().max() > 0.05
    assert (out - other).abs().max() > 0.05


def test_value_heads_of_another_size_with_sinks_and_window():
    """Multi-latent attention passes k_channels / v_channels: value heads (5 channels) narrower
    than query/key heads (8), through the sink key and its zero value."""
    b, s, dv = 2, 12, 5
    group = SimpleNamespace(size=lambda: 1)
    attention = SDPAttention(_config(), 1, AttnMaskType.causal, "self", k_channels=DIM,
                             v_channels=dv, pg_collection=SimpleNamespace(tp=group))
    with torch.no_grad():
        attention.softmax_offset.copy_(_sinks())
    q, k, _ = _qkv(b, s)
    v = torch.randn(s, b, GROUPS, dv, generator=torch.Generator().manual_seed(4), dtype=DTYPE)
    ours = _leaves(q, k, v)
    out = _ours(attention, *ours)
    assert out.shape == (s, b, HEADS * dv)
    theirs = _leaves(q, k, v)
    ref = _hf(*theirs, _sinks(), WINDOW)
    grad_out = torch.randn(s, b, HEADS * dv, generator=torch.Generator().manual_seed(5),
                           dtype=DTYPE)
    out.backward(grad_out)
    ref.backward(grad_out)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    for name, a, r in zip("qkv", ours, theirs):
        torch.testing.assert_close(a.grad, r.grad, rtol=0, atol=ATOL, msg=name)


def test_packed_samples_keep_their_own_window_and_sinks():
    """Two samples per row (boundaries 5 and 9) in megatron's block-diagonal mask: the same as
    transformers' packed GPT-OSS attention (positions restarting per sample), forward and
    backward; the causal-only mask gives another result (the check sees a leak)."""
    b, s = 2, 16
    sample_ids = torch.zeros(b, s + 1, dtype=torch.long)
    sample_ids[0, 5:], sample_ids[1, 9:] = 1, 1
    _, _, _, mask = inputs_labels_mask(torch.zeros(b, s + 1, dtype=torch.long),
                                       torch.ones(b, s + 1), sample_ids)
    ids = sample_ids[:, :-1]
    starts = torch.tensor([[0], [0]]).expand(b, s).clone()
    starts[0, 5:], starts[1, 9:] = 5, 9
    position_ids = torch.arange(s).unsqueeze(0) - starts
    attention = _attention(1)
    with torch.no_grad():
        attention.softmax_offset.copy_(_sinks())
    q, k, v = _qkv(b, s, seed=1)
    ours, theirs = _leaves(q, k, v), _leaves(q, k, v, _sinks())
    out = _ours(attention, *ours, mask)
    ref = _hf(*theirs[:3], theirs[3], WINDOW, position_ids)
    grad_out = torch.randn(s, b, HEADS * DIM, generator=torch.Generator().manual_seed(4),
                           dtype=DTYPE)
    out.backward(grad_out)
    ref.backward(grad_out)
    torch.testing.assert_close(out, ref, rtol=0, atol=ATOL)
    for a, r in zip(ours, theirs):
        torch.testing.assert_close(a.grad, r.grad, rtol=0, atol=ATOL)
    torch.testing.assert_close(attention.softmax_offset.grad, theirs[3].grad, rtol=0, atol=ATOL)
    assert ids[1, 8] != ids[1, 9]
    with torch.no_grad():
        leak = (_ours(attention, q, k, v) - out)[9:, 1].abs().max()
    assert leak > 0.05, leak


def test_cache_steps_and_off_by_one():
    """The last m queries against all keys (a KV-cache step, also one token, also passed as
    no_mask as megatron does past the prompt) give the full sequence's last m rows; off-by-one
    softmax is a sink fixed at 0."""
    b, s = 1, 12
    attention = _attention(1)
    with torch.no_grad():
        attention.softmax_offset.copy_(_sinks())
        q, k, v = _qkv(b, s, seed=2)
        full = _ours(attention, q, k, v)
        for m in (3, 1):
            torch.testing.assert_close(_ours(attention, q[-m:], k, v), full[-m:], rtol=0,
                                       atol=ATOL)
            # megatron passes no_mask for steps past the prompt (padded to the TP size under SP)
            step = attention(q[-m:], k, v, None, attn_mask_type=AttnMaskType.no_mask)
            torch.testing.assert_close(step, full[-m:], rtol=0, atol=ATOL)
        fixed = _attention(1, softmax_type="off-by-one")
        assert fixed.softmax_offset is None
        zero = torch.zeros(HEADS, dtype=DTYPE)
        torch.testing.assert_close(_ours(fixed, q, k, v), _hf(q, k, v, zero, WINDOW), rtol=0,
                                   atol=ATOL)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def test_nothing_of_size_heads_s_s_is_kept_for_backward():
    """The fused kernel runs (no softmax op, no [b, heads, s, s] scores); every tensor saved for
    backward is smaller than the scores would be; the mask is shared by layers of one kind."""
    b, s = 2, 48
    attention, other = (_attention(n, params_dtype=torch.float32) for n in (1, 3))
    q, k, v = _leaves(*_qkv(b, s, dtype=torch.float32))
    saved = []
    ops = _Ops()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with ops:
            out = _ours(attention, q, k, v)
    out.sum().backward()
    if not q.is_cuda:
        assert "_scaled_dot_product_flash_attention_for_cpu" in ops.names, ops.names
    assert not ops.names & {"_softmax", "softmax", "bmm", "baddbmm"}, ops.names
    scores = b * HEADS * s * s
    assert saved and max(t.numel() for t in saved) < scores / 2
    masks = [t for t in saved if t.dim() == 4 and t.shape[:2] == (1, 1)]
    assert len(masks) == 1 and masks[0].shape == (1, 1, s, s + 1)
    with torch.no_grad():
        from megatron_lora.models import sink_window

        mask = sink_window.attention_mask(s, s, True, attention.window, True, torch.float32, "cpu")
        assert mask is masks[0] and other.window == attention.window


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match=r"window_size=\(3, 2\) \(causal windows only"):
        SDPAttention(TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.0,
                                       window_size=(3, 2)), 1, AttnMaskType.causal, "self")


@multirank(world_size=2, timeout=240)
def test_sinks_are_sharded_with_the_heads_under_tp2(layout=ParallelLayout(tp=2)):
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    config = _config(tensor_model_parallel_size=2)
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self")
    assert attention.softmax_offset.shape == (HEADS // 2,)
    heads, groups = slice(2 * rank, 2 * rank + 2), slice(rank, rank + 1)
    with torch.no_grad():
        attention.softmax_offset.copy_(_sinks()[heads])
        q, k, v = _qkv(2, 12)
        out = attention(q[:, :, heads], k[:, :, groups], v[:, :, groups], None)
        ref = _hf(q, k, v, _sinks(), WINDOW).view(12, 2, HEADS, DIM)[:, :, heads]
    torch.testing.assert_close(out, ref.reshape(12, 2, -1), rtol=0, atol=ATOL)
    sharded = attention.sharded_state_dict(prefix="decoder.layers.0.self_attention.core_attention.")
    (tensor,) = sharded.values()
    assert tensor.key == "decoder.layers.0.self_attention.core_attention.softmax_offset"
    assert tensor.global_shape == (HEADS,) and tensor.global_offset == (2 * rank,)


@multirank(world_size=1, timeout=240)
def test_windowed_models_default_to_sdpa_since_megatron_drops_packed_masks(
        layout=ParallelLayout()):
    """megatron's DotProductAttention (sinks and window as well) replaces a packed mask by its
    window mask: its packed output is not transformers' packed attention (samples see each
    other); the local spec of a windowed config therefore defaults to SDPAttention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_lora.models.build import block_spec

    b, s = 2, 16
    sample_ids = torch.zeros(b, s + 1, dtype=torch.long)
    sample_ids[0, 5:], sample_ids[1, 9:] = 1, 1
    _, _, _, mask = inputs_labels_mask(torch.zeros(b, s + 1, dtype=torch.long),
                                       torch.ones(b, s + 1), sample_ids)
    starts = torch.zeros(b, s, dtype=torch.long)
    starts[0, 5:], starts[1, 9:] = 5, 9
    position_ids = torch.arange(s).unsqueeze(0) - starts
    megatron = DotProductAttention(_config(), 1, AttnMaskType.causal, "self")
    ours = SDPAttention(_config(), 1, AttnMaskType.causal, "self")
    q, k, v = _qkv(b, s, seed=1)
    with torch.no_grad():
        for m in (megatron, ours):
            m.softmax_offset.copy_(_sinks())
        ref = _hf(q, k, v, _sinks(), WINDOW, position_ids)
        torch.testing.assert_close(_ours(ours, q, k, v, mask), ref, rtol=0, atol=ATOL)
        torch.testing.assert_close(megatron(q, k, v, None), _hf(q, k, v, _sinks(), WINDOW),
                                   rtol=0, atol=ATOL)  # unpacked, megatron's is exact too
        assert (megatron(q, k, v, mask) - ref).abs().max() > 0.05
    spec = block_spec(_config(), pp_rank=0, use_te=False)
    attention = spec.submodules.layer_specs[0].submodules.self_attention.submodules
    assert attention.core_attention is SDPAttention
    spec = block_spec(_config(window=None), pp_rank=0, use_te=False)
    assert spec.submodules.layer_specs[0].submodules.self_attention.submodules.core_attention \
        is DotProductAttention
