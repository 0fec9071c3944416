"""Multi-latent attention (MLA: DeepSeek-V2/V3, Kimi-K2, Moonlight) on the local spec.

megatron-core's `MLASelfAttention` builds every projection, the q/kv latent norms and the
rotary embedding itself; only its core attention cannot be megatron's local one:
`MultiLatentAttention.__init__` builds the core attention with `k_channels=q_head_dim,
v_channels=v_head_dim` (megatron/core/transformer/multi_latent_attention.py lines 155-166 in
0.16.1, 207-218 in 0.19.2) and `DotProductAttention.__init__` (dot_product_attention.py line 42
in both) takes neither: "TypeError: __init__() got an unexpected keyword argument 'k_channels'".
`SDPAttention` (models/attention.py) takes both: query/key heads of qk_head_dim +
qk_pos_emb_head_dim, value heads of v_head_dim, torch's fused SDPA (no [b, heads, s, s] tensor
kept for backward), causal or a packed block-diagonal mask, and the softmax scale MLA passes:
mscale^2 / sqrt(q_head_dim) with mscale = 0.1 * mscale_all_dim * ln(factor) + 1 (1 when
factor <= 1 or mscale_all_dim is 0), transformers' `yarn_apply_mscale` exactly.

`mla_attention_spec()` gives MLASelfAttention (as `LocalMLASelfAttention`, which refuses what
the local path cannot run) with ColumnParallelLinear down projections (output rows split over
TP, gathered back whole), ColumnParallelLinear up projections (heads split over TP), a
RowParallelLinear output, our RMSNorm (SP-safe) for both latent norms and SDPAttention.
Two corrections to megatron's module, both in `LocalMLASelfAttention`: under TP it gathers the
kv down projection's chunks itself so that the shared rope key's gradient is summed over the
ranks' heads (megatron's own gather kept each rank's part only: the input gradient was off by
0.19 at TP2, with or without SP, on 0.16.1 and 0.19.2); on 0.19 it builds the spec's latent
norms as 0.16 does (`_resolve_qk_norm_config`; runtime/versions.py has the row). The same spec
serves q_lora_rank set (q down -> q norm -> q up) and None (one linear_q_proj,
DeepSeek-V2-Lite). `mla_config_kwargs(shape)` gives the MLATransformerConfig fields of a
ModelShape with `mla` (models/gpt.py builds the config from it).

Rope: megatron rotates the last qk_pos_emb_head_dim channels of each query head and the one
shared key channel group, YaRN through `YarnRotaryEmbedding` (rope_type "yarn": cos/sin times
the mscale / mscale_all_dim ratio, transformers' attention_factor) or plain RotaryEmbedding
(rope_type "rope"). With `multi_latent_attention` set, megatron's rotation
(models/common/embeddings/rope_utils.py `_apply_rotary_pos_emb_bshd`) first de-interleaves the
channels, [x0, x1, x2, x3, ...] -> [x0, x2, ..., x1, x3, ...], then rotates half: it rotates
adjacent pairs (x0, x1), (x2, x3), ..., which is DeepSeek's own layout (transformers'
rope_interleave=True, DeepSeek-V2's complex rotation), so those weights are copied unchanged.
A checkpoint with rope_interleave=False (transformers rotates half of the raw channels) gets
its rope rows interleaved (I = the inverse of that de-interleave) so that megatron's
de-interleave restores them. megatron runs with rotary_interleaved=False (MLATransformerConfig
refuses it with MLA) and apply_rope_fusion=False (a Triton kernel).

One layer, HF `self_attn.` -> megatron `self_attention.` (global tensors; r = qk_rope_head_dim;
I(rope) = the r rope rows interleaved when rope_interleave is False, unchanged when True; n heads):

| HF | megatron | shape | TP split (dim 0 unless said) |
|---|---|---|---|
| q_a_proj.weight | linear_q_down_proj.weight | [q_lora_rank, h] | rows, gathered back |
| q_a_layernorm.weight | q_layernorm.weight | [q_lora_rank] | replicated |
| q_b_proj.weight (q_proj.weight if q_lora_rank is None) | linear_q_up_proj.weight (linear_q_proj.weight) | [n * (nope + r), q_lora_rank or h], per head [nope; I(rope)] | heads |
| kv_a_proj_with_mqa.weight | linear_kv_down_proj.weight | [kv_lora_rank + r, h], [latent; I(rope)] | rows, gathered back |
| kv_a_layernorm.weight | kv_layernorm.weight | [kv_lora_rank] | replicated |
| kv_b_proj.weight | linear_kv_up_proj.weight | [n * (nope + v), kv_lora_rank], per head [nope; v] | heads |
| o_proj.weight | linear_proj.weight | [h, n * v] | dim 1 (heads) |

Refused here (one line): TP sizes that do not divide q_lora_rank, kv_lora_rank +
qk_rope_head_dim or the heads (ModelInfo.layout_problems says so earlier, naming the flag),
apply_rope_fusion, cache_mla_latents, and `packed_seq_params` (packed samples come as the
block-diagonal attention_mask of megatron_lora.data.packing: rope is relative, so positions
running on across samples give each sample's own scores). The family reader
(families/deepseek_v3.py) refuses, naming the config.json field, what the config could ask and
megatron's MLA cannot do: attention_bias, rope types other than default and yarn, YaRN with an
explicit attention_factor, truncate false, mscale_all_dim without mscale.
"""

from __future__ import annotations

from typing import Dict, Mapping

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import (
    MLASelfAttention,
    MLASelfAttentionSubmodules,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_lora.models.attention import SDPAttention
from megatron_lora.models.norm import RMSNorm
from megatron_lora.runtime.versions import mla_without_transformer_engine


def _config_problems(config) -> list:
    problems = []
    for field in ("apply_rope_fusion", "cache_mla_latents"):
        if getattr(config, field, False):
            problems.append(f"{field}=True")
    return problems


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over `group`. (megatron's
    copy_to_tensor_model_parallel_region all-reduces `grad.contiguous()`, a copy that is then
    dropped when the gradient is a non-contiguous slice, as the rope key's is.)"""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class LocalMLASelfAttention(MLASelfAttention):
    """megatron-core's MLASelfAttention, refusing at construction what the local path cannot
    run (apply_rope_fusion: a Triton kernel; cache_mla_latents: Flash MLA) and
    packed_seq_params in forward (megatron's config refuses rotary_interleaved itself).
    Parallel state: hidden_states [s, b, h] ([s/tp, b, h] under SP) -> output [s (or s/tp),
    b, h] and the linear_proj bias (None)."""

    def __init__(self, config, submodules, layer_number, *args, **kwargs):
        problems = _config_problems(config)
        tp = config.tensor_model_parallel_size
        sizes = {"q_lora_rank": config.q_lora_rank or 0,
                 "kv_lora_rank + qk_rope_head_dim":
                     config.kv_lora_rank + config.qk_pos_emb_head_dim,
                 "num_attention_heads": config.num_attention_heads}
        uneven = [f"{name}={size}" for name, size in sizes.items() if size % tp]
        if uneven:
            raise ValueError(
                f"multi-latent attention needs {', '.join(uneven)} to divide by the "
                f"tensor-parallel size {tp}; choose another --tensor-model-parallel-size")
        if problems:
            raise ValueError(
                "multi-latent attention on the local spec does not support "
                + "; ".join(problems) + " (see megatron_lora/models/mla.py); set them to False")
        mla_without_transformer_engine()
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        if self.linear_kv_down_proj.weight.shape[0] != config.kv_lora_rank + \
                config.qk_pos_emb_head_dim:
            self.linear_kv_down_proj.register_forward_hook(self._whole_kv_latent)

    def _whole_kv_latent(self, module, inputs, output):
        """linear_kv_down_proj's TP chunk [s, b, (kv_lora_rank + r) / tp] -> the whole latent
        and shared rope key [s (s/tp under SP), b, kv_lora_rank + r], so MLA splits it without
        its own gather.

        megatron gathers the chunks itself, but the backward of that gather keeps each rank's
        chunk of its own gradient, and the rope key's gradient differs by rank (each rank's
        heads use it): the other ranks' part was lost (an input gradient off by 0.19 at TP2
        in tests/models/test_mla.py). Here the rope key's gradient is all-reduced over TP
        first; under SP the tokens go back to this rank's slice and MLA gathers the rope key
        over the sequence, whose backward sums it. The latent's gradient is the same on every
        rank already (linear_kv_up_proj's backward all-reduces it, or gathers it under SP)."""
        out, bias = output
        whole = gather_from_tensor_model_parallel_region(out)
        if self.config.sequence_parallel:
            return scatter_to_sequence_parallel_region(whole), bias
        latent, rope = torch.split(
            whole, [self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim], dim=-1)
        rope = _SumGradOverGroup.apply(rope, self.pg_collection.tp)
        return torch.cat([latent, rope], dim=-1), bias

    def _resolve_qk_norm_config(self, submodules) -> dict:
        """The spec's projections and latent norms as they are (megatron-core 0.19 asks this;
        0.16 builds the spec's modules directly). 0.19's own resolver ties the latent norms to
        config.qk_layernorm and, without q_lora_rank, wants a norm fused into linear_q_proj,
        which the local backend does not have: DeepSeek-V2-Lite's q_proj plus kv norm could
        not be built."""
        return dict(linear_q_proj=submodules.linear_q_proj,
                    linear_q_up_proj=submodules.linear_q_up_proj,
                    linear_kv_up_proj=submodules.linear_kv_up_proj,
                    q_layernorm=submodules.q_layernorm, kv_layernorm=submodules.kv_layernorm)

    def forward(self, hidden_states, attention_mask, *args, packed_seq_params=None, **kwargs):
        if packed_seq_params is not None:
            raise ValueError(
                "multi-latent attention takes packed samples as a block-diagonal attention_mask "
                "[b, 1, s, s] (megatron_lora.data.packing), not packed_seq_params")
        return super().forward(hidden_states, attention_mask, *args, **kwargs)


def mla_attention_spec() -> ModuleSpec:
    """The self_attention spec of an MLA layer (q_lora_rank set or None: the config decides)."""
    return ModuleSpec(
        module=LocalMLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear,
            linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear,
            linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear,
            core_attention=SDPAttention,
            linear_proj=RowParallelLinear,
            q_layernorm=RMSNorm,
            kv_layernorm=RMSNorm,
        ),
    )


def mla_config_kwargs(shape) -> Dict[str, object]:
    """The MLATransformerConfig fields of a ModelShape with `mla` (families/shape.py MlaShape):
    the latent ranks and head sizes, and its RoPE as megatron's MLA reads it (rope_type "rope",
    or "yarn" with transformers' rule for the two mscales: with mscale_all_dim, cos/sin are
    scaled by the mscale ratio and the softmax by mscale(mscale_all_dim)^2; without it, cos/sin
    by the plain YaRN mscale and the softmax not at all, which megatron does for mscale 1,
    mscale_all_dim 0). The family reader has refused what megatron cannot express (YaRN truncate
    false, mscale_all_dim without mscale)."""
    m, yarn = shape.mla, shape.yarn
    out = dict(multi_latent_attention=True, q_lora_rank=m.q_lora_rank,
               kv_lora_rank=m.kv_lora_rank, qk_head_dim=m.qk_head_dim,
               qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
               rotary_interleaved=False, apply_rope_fusion=False,
               rotary_base=float(shape.rotary_base))
    if yarn is None:
        return dict(out, rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0,
                    mscale_all_dim=0.0)
    if not yarn.truncate or (yarn.mscale_all_dim and not yarn.mscale):
        raise ValueError(f"multi-latent attention cannot follow YaRN with truncate="
                         f"{yarn.truncate}, mscale={yarn.mscale}, mscale_all_dim="
                         f"{yarn.mscale_all_dim}")
    mscale, all_dim = (yarn.mscale, yarn.mscale_all_dim) if yarn.mscale_all_dim else (1.0, 0.0)
    return dict(out, rope_type="yarn", rotary_scaling_factor=yarn.factor,
                original_max_position_embeddings=yarn.original_max_position_embeddings,
                beta_fast=yarn.beta_fast, beta_slow=yarn.beta_slow, mscale=float(mscale),
                mscale_all_dim=float(all_dim))


def _deinterleave(rope_dim: int) -> torch.Tensor:
    """[0, 2, 4, ..., 1, 3, 5, ...] over rope_dim channels (megatron's MLA de-interleave)."""
    return torch.cat([torch.arange(0, rope_dim, 2, device="cpu"),
                      torch.arange(1, rope_dim, 2, device="cpu")])


def _permute_rope_rows(weight: torch.Tensor, lead: int, rope: int, groups: int,
                       perm: torch.Tensor) -> torch.Tensor:
    """weight [groups * (lead + rope), in]: the last `rope` rows of each group reordered."""
    w = weight.reshape(groups, lead + rope, -1)
    w = torch.cat([w[:, :lead], w[:, lead:][:, perm]], dim=1)
    return w.reshape(weight.shape)


def _rope_rows(state: Dict[str, torch.Tensor], mla, heads: int, perm: torch.Tensor, q_key: str,
               kv_key: str) -> None:
    r = mla.qk_pos_emb_head_dim
    state[q_key] = _permute_rope_rows(state[q_key], mla.qk_head_dim, r, heads, perm)
    state[kv_key] = _permute_rope_rows(state[kv_key], mla.kv_lora_rank, r, 1, perm)


def rope_row_order(mla, to_mcore: bool) -> torch.Tensor:
    """The order of a rope part's rows on the other side: megatron's rows are the checkpoint's
    as they are when the checkpoint is interleaved (rope_interleaved), else interleaved
    (to_mcore) or de-interleaved back (not to_mcore)."""
    r = mla.qk_pos_emb_head_dim
    if mla.rope_interleaved:
        return torch.arange(r, device="cpu")
    return torch.argsort(_deinterleave(r)) if to_mcore else _deinterleave(r)


def _names(mla) -> Dict[str, str]:
    """HF name -> megatron name for one layer's attention (no layer prefix)."""
    names = {"kv_a_proj_with_mqa.weight": "linear_kv_down_proj.weight",
             "kv_a_layernorm.weight": "kv_layernorm.weight",
             "kv_b_proj.weight": "linear_kv_up_proj.weight",
             "o_proj.weight": "linear_proj.weight"}
    if mla.q_lora_rank is None:
        names["q_proj.weight"] = "linear_q_proj.weight"
    else:
        names.update({"q_a_proj.weight": "linear_q_down_proj.weight",
                      "q_a_layernorm.weight": "q_layernorm.weight",
                      "q_b_proj.weight": "linear_q_up_proj.weight"})
    return names


def hf_to_mcore_attention(hf: Mapping[str, torch.Tensor], mla, heads: int
                          ) -> Dict[str, torch.Tensor]:
    """One layer's HF attention tensors (keys as in the table, without `model.layers.i.self_attn.`)
    -> megatron's global tensors (keys without `decoder.layers.i.self_attention.`); rope rows
    interleaved when the checkpoint's rope is not (rope_interleave False), else unchanged.
    Other keys are refused."""
    names = _names(mla)
    missing, extra = sorted(set(names) - set(hf)), sorted(set(hf) - set(names))
    if missing or extra:
        raise ValueError(f"multi-latent attention tensors: missing {missing}, unexpected {extra}")
    out = {names[k]: v for k, v in hf.items()}
    q_key = "linear_q_proj.weight" if mla.q_lora_rank is None else "linear_q_up_proj.weight"
    _rope_rows(out, mla, heads, rope_row_order(mla, True), q_key, "linear_kv_down_proj.weight")
    return out


def mcore_to_hf_attention(mcore: Mapping[str, torch.Tensor], mla, heads: int
                          ) -> Dict[str, torch.Tensor]:
    """The inverse of hf_to_mcore_attention (rope rows de-interleaved back when
    rope_interleave is False)."""
    back = {v: k for k, v in _names(mla).items()}
    missing, extra = sorted(set(back) - set(mcore)), sorted(set(mcore) - set(back))
    if missing or extra:
        raise ValueError(f"multi-latent attention tensors: missing {missing}, unexpected {extra}")
    out = {back[k]: v for k, v in mcore.items()}
    q_key = "q_proj.weight" if mla.q_lora_rank is None else "q_b_proj.weight"
    _rope_rows(out, mla, heads, rope_row_order(mla, False), q_key, "kv_a_proj_with_mqa.weight")
    return out


__all__ = ["LocalMLASelfAttention", "hf_to_mcore_attention", "mcore_to_hf_attention",
           "mla_attention_spec", "mla_config_kwargs", "rope_row_order"]
