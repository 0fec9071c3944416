"""Layer and block specs for megatron-core GPT models built from local (non-TE) modules.

The local spec of megatron-core 0.16 uses WrappedTorchNorm, which refuses sequence parallelism.
`local_block_spec` swaps every norm (input, pre-MLP, and the final one) for our `RMSNorm`, so the
same spec runs on CPU and on GPUs without Transformer Engine, with or without SP.

`attention_backend` picks the core attention with Megatron-LM's `--attention-backend` names:
None (the default), "unfused" or "local" keep megatron's DotProductAttention (scores and
probabilities [b, heads, s, s] kept for backward); "flash" or "auto" use
`megatron_lora.models.attention.SDPAttention` (torch's fused scaled_dot_product_attention, memory
linear in s); "fused" (Transformer Engine's fused attention) is refused.

`moe_grouped_gemm` (Megatron-LM's `--moe-grouped-gemm`) builds the experts as
`megatron_lora.models.grouped_experts.GroupedExperts` (all local experts in one grouped matmul per
weight, checkpoints identical to SequentialMLP's) instead of megatron's SequentialMLP.

`qk_norm_full_width` (OLMoE) builds the query and key norms as
`megatron_lora.models.qk_norm.FullWidthQueryNorm` / `FullWidthKeyNorm` (one RMS over the whole
projection, exact under TP) instead of per-head RMSNorms; `with_qk_norms` applies the same
choice to another spec (the Transformer Engine one).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_lora.families.shape import moe_layer_pattern
from megatron_lora.models.attention import SDPAttention
from megatron_lora.models.grouped_experts import GroupedExperts
from megatron_lora.models.norm import RMSNorm
from megatron_lora.models.qk_norm import FullWidthKeyNorm, FullWidthQueryNorm
from megatron_lora.runtime.versions import spec_replace, spec_submodules

ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")


def core_attention_class(attention_backend: Optional[str]) -> type:
    """The local spec's core_attention module for a Megatron-LM `--attention-backend` name."""
    if attention_backend is None or attention_backend in ("unfused", "local"):
        return DotProductAttention
    if attention_backend in ("flash", "auto"):
        return SDPAttention
    if attention_backend == "fused":
        raise ValueError(
            "attention backend 'fused' is Transformer Engine's fused attention, which "
            "megatron_lora does not select; use 'flash' (torch's fused scaled_dot_product_attention"
            ", memory linear in the sequence) or 'unfused' (megatron's DotProductAttention)"
        )
    raise ValueError(
        f"unknown attention backend {attention_backend!r}; choose one of "
        f"{', '.join(b for b in ATTENTION_BACKENDS if b != 'fused')}"
    )


def _with_core_attention(attention_spec, core_attention: type):
    """A copy of a self-attention spec whose submodules build `core_attention`."""
    submodules = dataclasses.replace(spec_submodules(attention_spec), core_attention=core_attention)
    return spec_replace(attention_spec, submodules=submodules)


def _with_grouped_experts(mlp_spec):
    """A copy of an MoE layer spec whose experts are GroupedExperts (same submodules)."""
    moe = spec_submodules(mlp_spec)
    experts = spec_replace(moe.experts, module=GroupedExperts)
    return spec_replace(mlp_spec, submodules=dataclasses.replace(moe, experts=experts))


def with_qk_norms(layer_spec, full_width: bool):
    """A copy of a TransformerLayer spec whose query/key norms are ours: per-head RMSNorm, or
    the full-width norms of models.qk_norm (full_width)."""
    q, k = (FullWidthQueryNorm, FullWidthKeyNorm) if full_width else (RMSNorm, RMSNorm)
    layer = spec_submodules(layer_spec)
    attention = layer.self_attention
    attention = spec_replace(attention, submodules=dataclasses.replace(
        spec_submodules(attention), q_layernorm=q, k_layernorm=k))
    return spec_replace(layer_spec, submodules=dataclasses.replace(layer, self_attention=attention))


def local_layer_spec(
    num_experts: Optional[int] = None,
    moe_grouped_gemm: bool = False,
    attention_backend: Optional[str] = None,
    qk_layernorm: bool = False,
    qk_norm_full_width: bool = False,
) -> ModuleSpec:
    """A TransformerLayer spec with local linears, SequentialMLP experts (GroupedExperts with
    moe_grouped_gemm), RMSNorm (also per query/key head with qk_layernorm, or over the whole
    query / key width with qk_norm_full_width as well), and the core attention
    `attention_backend` names (see the module docstring)."""
    core_attention = core_attention_class(attention_backend)
    # megatron's own grouped experts need Transformer Engine (or, before 0.17, the grouped_gemm
    # package): ask for SequentialMLP and swap in GroupedExperts, which keeps its checkpoints.
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm",
        qk_layernorm=qk_layernorm,
    )
    # Copy, do not mutate: megatron's spec objects may be shared.
    replaced = dict(input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm)
    if moe_grouped_gemm and num_experts:
        replaced["mlp"] = _with_grouped_experts(spec.submodules.mlp)
    attention = spec.submodules.self_attention
    if core_attention is not DotProductAttention:
        attention = _with_core_attention(attention, core_attention)
    if attention is not spec.submodules.self_attention:
        replaced["self_attention"] = attention
    submodules = dataclasses.replace(spec.submodules, **replaced)
    spec = dataclasses.replace(spec, submodules=submodules)
    if qk_layernorm:  # megatron's per-head norm is WrappedTorchNorm, refused under SP
        spec = with_qk_norms(spec, qk_norm_full_width)
    return spec


def stage_layer_specs(config: TransformerConfig, pp_rank: Optional[int], moe_layer,
                      dense_layer) -> list:
    """This pipeline stage's layer specs: `moe_layer` or `dense_layer` by the global index of
    each layer it builds (megatron's own stage offset)."""
    num_layers = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    pattern = moe_layer_pattern(config.moe_layer_freq, config.num_layers, config.num_moe_experts)
    if all(pattern):
        return [moe_layer] * num_layers
    offset = get_transformer_layer_offset(config, vp_stage=None, pp_rank=pp_rank)
    return [moe_layer if pattern[offset + i] else dense_layer for i in range(num_layers)]


# Multi-latent attention's latent norms are stored where Transformer Engine's spec keeps them
# (fused into the up projections), as the input and pre-MLP norms of the GQA spec are, so one
# checkpoint serves both; the input norm stays `input_layernorm.` (TE's MLA spec keeps it apart).
MLA_KEYS_MAP = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
                "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
                "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_"}


def with_mla(layer_spec):
    """A copy of a TransformerLayer spec whose self-attention is multi-latent attention
    (models/mla.py, torch's SDPA core), its checkpoint keys as MLA_KEYS_MAP says."""
    from megatron_lora.models.mla import mla_attention_spec

    layer = spec_submodules(layer_spec)
    return spec_replace(layer_spec, submodules=dataclasses.replace(
        layer, self_attention=mla_attention_spec(), sharded_state_dict_keys_map=dict(MLA_KEYS_MAP)))


def local_block_spec(
    config: TransformerConfig,
    pp_rank: Optional[int] = None,
    moe_grouped_gemm: bool = False,
    attention_backend: Optional[str] = None,
    qk_norm_full_width: bool = False,
) -> ModuleSpec:
    """A TransformerBlock spec for this pipeline stage's layers with an RMSNorm final norm;
    dense layers (config.moe_layer_freq) get a dense MLP; qk_norm_full_width: the model's
    query/key norms run over the whole width (OLMoE, ModelShape.qk_norm_full_width)."""
    if qk_norm_full_width and not config.qk_layernorm:
        raise ValueError("qk_norm_full_width needs a config with qk_layernorm")

    def layer(num_experts):
        spec = local_layer_spec(num_experts, moe_grouped_gemm, attention_backend,
                                qk_layernorm=config.qk_layernorm,
                                qk_norm_full_width=qk_norm_full_width)
        return with_mla(spec) if getattr(config, "multi_latent_attention", False) else spec

    layers = stage_layer_specs(config, pp_rank, layer(config.num_moe_experts), layer(None))
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=layers, layer_norm=RMSNorm),
    )
