"""GPT models in megatron-core from a `ModelShape`: the TransformerConfig and the model builder."""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lora.families.shape import ModelShape, tiny_moe_shape  # noqa: F401 (re-exported)
from megatron_lora.runtime.layout import ParallelLayout


def transformer_config(
    shape: ModelShape,
    layout: ParallelLayout,
    *,
    dtype: torch.dtype = torch.float32,
    dispatcher: str = "allgather",
    init_method_std: float = 0.02,
    **overrides,
) -> TransformerConfig:
    """megatron-core TransformerConfig for `shape` at `layout` (a fresh object every call)."""
    kwargs = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        # the dense layers' MLP (experts take moe_ffn_hidden_size)
        ffn_hidden_size=shape.dense_ffn_hidden_size or shape.ffn_hidden_size,
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=init_method_std,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        sequence_parallel=layout.sp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        # Losses are token sums; megatron_lora.training normalises by the global token count.
        calculate_per_token_loss=True,
    )
    if shape.num_experts:
        kwargs.update(
            num_moe_experts=shape.num_experts,
            moe_router_topk=shape.moe_router_topk,
            moe_ffn_hidden_size=shape.ffn_hidden_size,
            moe_token_dispatcher_type=dispatcher,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_router_dtype="fp32",
            moe_router_pre_softmax=shape.moe_router_pre_softmax,
        )
        kwargs.update(_sigmoid_router_kwargs(shape))
        if shape.moe_layer_pattern:  # a list, never megatron's int (l % freq == 0 is not HF's)
            kwargs["moe_layer_freq"] = list(shape.moe_layer_pattern)
        if shape.shared_expert_ffn_hidden_size:
            kwargs.update(moe_shared_expert_intermediate_size=shape.shared_expert_ffn_hidden_size,
                          moe_shared_expert_gate=shape.shared_expert_gate)
    if shape.add_qkv_bias:
        kwargs["add_qkv_bias"] = True
    kwargs.update(_gpt_oss_kwargs(shape))
    if shape.qk_layernorm:
        kwargs["qk_layernorm"] = True
    config_class = TransformerConfig
    if shape.mla is not None:  # multi-latent attention: its own config class (models/mla.py)
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        from megatron_lora.models.mla import mla_config_kwargs

        config_class = MLATransformerConfig
        kwargs.update(mla_config_kwargs(shape))
    kwargs.update(overrides)
    config = config_class(**kwargs)
    if shape.mla is None:  # MLA reads YaRN from its own fields (mla_config_kwargs)
        _set_yarn(config, shape)
    return config


def _set_yarn(config: TransformerConfig, shape: ModelShape) -> None:
    """YaRN's fields on `config`, which megatron-core's GPTModel (position_embedding_type "yarn")
    and SelfAttention read with getattr (TransformerConfig declares them only in its MLA
    subclass, in 0.16 and 0.19 alike). megatron's YarnRotaryEmbedding computes transformers'
    frequencies (bit for bit, tests/models/test_yarn.py); the attention factor (cos and sin
    multiplied by it, SelfAttention's `mscale`) is megatron's mscale ratio when both mscale
    fields are given and get_mscale(factor) when they are None, which is transformers' rule
    only if the pair is passed exactly when both are non-zero (transformers ignores a lone
    mscale; megatron would divide by get_mscale(factor, 0) = 1 and use it)."""
    yarn = shape.yarn
    if yarn is None:
        return
    ratio = yarn.uses_mscale_ratio
    config.yarn_rotary_scaling_factor = yarn.factor
    config.yarn_original_max_position_embeddings = yarn.original_max_position_embeddings
    config.yarn_beta_fast = yarn.beta_fast
    config.yarn_beta_slow = yarn.beta_slow
    config.yarn_mscale = yarn.mscale if ratio else None
    config.yarn_mscale_all_dim = yarn.mscale_all_dim if ratio else None
    config.yarn_correction_range_round_to_int = yarn.truncate


def _sigmoid_router_kwargs(shape: ModelShape) -> dict:
    """TransformerConfig fields for sigmoid routing with a score-correction bias, groups and a
    scaling factor (GLM-4.5); {} for a softmax router without them."""
    kwargs = {}
    if shape.moe_router_score_function != "softmax":
        kwargs["moe_router_score_function"] = shape.moe_router_score_function
    if shape.moe_router_expert_bias:
        # The bias is a frozen part of the base model: megatron would move it every step inside
        # finalize_model_grads (aux-loss-free balancing); an update rate of 0 keeps it as loaded.
        kwargs.update(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.0)
    if shape.moe_router_num_groups:
        kwargs.update(moe_router_num_groups=shape.moe_router_num_groups,
                      moe_router_group_topk=shape.moe_router_group_topk)
    if shape.moe_router_topk_scaling_factor is not None:
        kwargs["moe_router_topk_scaling_factor"] = shape.moe_router_topk_scaling_factor
    return kwargs


def _gpt_oss_kwargs(shape: ModelShape) -> dict:
    """TransformerConfig fields for biases on every linear, the clamped SwiGLU, learned
    attention sinks and per-layer sliding windows (GPT-OSS); {} for a shape without them."""
    from megatron_lora.models.activations import SigmoidGate

    kwargs = {}
    if shape.add_bias_linear:
        kwargs.update(add_bias_linear=True, bias_activation_fusion=False)
    if shape.swiglu_alpha is not None:
        kwargs.update(activation_func=SigmoidGate(shape.swiglu_alpha), glu_linear_offset=1.0,
                      activation_func_clamp_value=float(shape.swiglu_limit))
    if shape.attention_sinks:
        kwargs["softmax_type"] = "learnable"
    if shape.sliding_window is not None:
        # megatron's window (left, right): key j visible to query i when i - left <= j <= i;
        # HF's sliding_window W keeps j > i - W, so left = W - 1.
        kwargs["window_size"] = (shape.sliding_window - 1, 0)
        if shape.window_layers is not None:
            kwargs["window_attn_skip_freq"] = [int(bool(w)) for w in shape.window_layers]
    return kwargs


def build_gpt_model(shape: ModelShape, config: TransformerConfig, block_spec=None,
                    attention_backend: Optional[str] = None) -> GPTModel:
    """This pipeline stage's GPTModel with RoPE (YaRN-scaled for `shape.yarn`); `block_spec` defaults to the local (CPU-capable)
    spec of megatron_lora.models.specs with the core attention `attention_backend` names
    (Megatron-LM's names; None keeps megatron's DotProductAttention; see models.specs)."""
    from megatron_lora.models.specs import local_block_spec

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if block_spec is None:
        block_spec = local_block_spec(config, pp_rank=pp_rank, attention_backend=attention_backend,
                                      qk_norm_full_width=shape.qk_norm_full_width)
    elif attention_backend is not None:
        raise ValueError("build_gpt_model: pass attention_backend or block_spec, not both")
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec,
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_embeddings,
        # MLA builds its own rotary embedding (plain or YaRN) from its config
        position_embedding_type="yarn" if shape.yarn is not None and shape.mla is None
        else "rope",
        rotary_base=int(shape.rotary_base),
        rotary_percent=shape.rotary_percent,
    )
    from megatron_lora.lora.input_grad import require_decoder_input_grad
    from megatron_lora.models.recompute import recomputes_parameters

    if recomputes_parameters(config):  # frozen embeddings: see models/recompute.py
        require_decoder_input_grad(model)
    return model


def shape_dict(shape: ModelShape) -> dict:
    return asdict(shape)
