"""A model of any supported family in megatron-core: its TransformerConfig and layer specs.

`block_spec` picks the layer spec: Transformer Engine layers when TE is importable and requested
(GPU), otherwise the local spec with the sequence-parallel RMSNorm (CPU or GPU). Both specs have
the same sharded-state-dict keys, so one checkpoint serves both. `model_config` and `build_model`
read everything about the model from its `families.ModelInfo`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_lora.families import ModelInfo
from megatron_lora.models.gpt import transformer_config
from megatron_lora.runtime.layout import ParallelLayout


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def default_grouped_experts() -> bool:
    """What moe_grouped_gemm=None means for the local spec: grouped experts on CUDA only."""
    return torch.cuda.is_available()


def block_spec(config, pp_rank: Optional[int] = None, use_te: Optional[bool] = None,
                       attention_backend: Optional[str] = None,
                       moe_grouped_gemm: Optional[bool] = None, qk_norm_full_width: bool = False):
    """TransformerBlock spec for this pipeline stage.

    use_te: True requires Transformer Engine (TE linears fused with RMSNorm, TENorm final norm,
    SequentialMLP experts of TE linears); False is the local spec; None picks TE when it is
    importable and CUDA is usable.
    attention_backend: Megatron-LM's `--attention-backend` name for the local spec's core
    attention (models.specs); None keeps megatron's DotProductAttention, except for models with
    sliding windows (GPT-OSS), where None is SDPAttention (see below). The TE spec always uses
    TEDotProductAttention (None or "auto" only).
    moe_grouped_gemm: GroupedExperts (models/grouped_experts.py) instead of SequentialMLP in the
    local spec; checkpoints are the same either way. None (the default): grouped experts with
    the local spec on CUDA (where torch._grouped_mm runs them), SequentialMLP on CPU (where the
    grouped loop measured 5-8% slower than SequentialMLP, docs/training.md) and with the TE
    spec; True with the TE spec is refused.
    qk_norm_full_width: query/key norms over the whole projection (ModelShape.qk_norm_full_width,
    OLMoE); both specs build them as models.qk_norm's modules (TE has only per-head norms).
    """
    from megatron_lora.models.specs import (core_attention_class, local_block_spec,
                                            stage_layer_specs, with_qk_norms)

    core_attention_class(attention_backend)  # an unknown or unsupported name fails first
    if getattr(config, "multi_latent_attention", False):
        # multi-latent attention is built on the local spec only (models/mla.py: its core
        # attention and a TP gradient correction are ours)
        if use_te:
            raise ValueError("multi-latent attention (DeepSeek) is built from the local spec; "
                             "pass use_te=False (or leave it unset)")
        use_te = False
    if use_te is None:
        use_te = te_available() and torch.cuda.is_available()
    if not use_te and attention_backend is None and getattr(config, "window_size", None):
        # megatron's DotProductAttention replaces a packed-sample mask by its sliding-window
        # mask, so packed samples would attend across their boundaries; SDPAttention combines
        # both (models/sink_window.py). "unfused" still selects it explicitly.
        attention_backend = "flash"
    if not use_te:
        return local_block_spec(config, pp_rank=pp_rank, attention_backend=attention_backend,
                                moe_grouped_gemm=default_grouped_experts()
                                if moe_grouped_gemm is None else moe_grouped_gemm,
                                qk_norm_full_width=qk_norm_full_width)
    if moe_grouped_gemm:
        raise ValueError(
            "grouped experts (--moe-grouped-gemm) are built from the local spec; the Transformer "
            "Engine spec keeps SequentialMLP experts (pass use_te=False, or no --moe-grouped-gemm)"
        )
    if attention_backend not in (None, "auto"):
        raise ValueError(
            f"attention backend {attention_backend!r} selects the local spec's core attention; "
            "the Transformer Engine spec uses TEDotProductAttention (pass use_te=False or "
            "attention backend 'auto')"
        )
    if not te_available():
        raise RuntimeError("use_te=True but transformer_engine is not importable")
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
    )

    def layer(num_experts):
        spec = get_gpt_layer_with_transformer_engine_spec(num_experts, moe_grouped_gemm=False,
                                                          qk_layernorm=config.qk_layernorm)
        if qk_norm_full_width:
            spec = with_qk_norms(spec, full_width=True)
        # TE fuses the input norm into linear_qkv (key linear_qkv.layer_norm_weight); the MoE
        # pre-MLP norm is a separate TENorm. Store it under the same key as the local spec
        # does, so one checkpoint serves both specs.
        keys_map = dict(spec.submodules.sharded_state_dict_keys_map or {})
        keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
        return dataclasses.replace(spec, submodules=dataclasses.replace(
            spec.submodules, sharded_state_dict_keys_map=keys_map))

    layers = stage_layer_specs(config, pp_rank, layer(config.num_moe_experts), layer(None))
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=layers, layer_norm=TENorm),
    )


def model_config(info: ModelInfo, layout: ParallelLayout, *, dtype: torch.dtype = torch.float32,
                 dispatcher: str = "allgather", **overrides):
    """megatron-core TransformerConfig for `info` at `layout` (RMSNorm, SwiGLU, top-k softmax
    router without load balancing, RoPE from config.json)."""
    return transformer_config(info.shape, layout, dtype=dtype, dispatcher=dispatcher, **overrides)


def build_model(info: ModelInfo, config, use_te: Optional[bool] = None,
                attention_backend: Optional[str] = None, moe_grouped_gemm: Optional[bool] = None):
    """This pipeline stage's GPTModel for `info` (megatron parallel state must be initialised).

    attention_backend, moe_grouped_gemm: see block_spec (None keeps megatron's
    DotProductAttention; None grouped experts on the local spec).

    The model's vocabulary is the padded one ([Vp/tp, h] embedding and output shards per TP rank);
    its logits are [b, s, Vp/tp] per TP rank with parallel_output=True.
    """
    from megatron.core import parallel_state

    from megatron_lora.models.gpt import build_gpt_model

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    spec = block_spec(config, pp_rank=pp_rank, use_te=use_te, attention_backend=attention_backend,
                      moe_grouped_gemm=moe_grouped_gemm,
                      qk_norm_full_width=info.shape.qk_norm_full_width)
    return build_gpt_model(info.shape, config, block_spec=spec)
