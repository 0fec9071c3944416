"""Layer and block specs for megatron-core GPT models built from local (non-TE) modules.

The local spec of megatron-core 0.16 uses WrappedTorchNorm, which refuses sequence parallelism.
`local_block_spec` swaps every norm (input, pre-MLP, and the final one) for our `RMSNorm`, so the
same spec runs on CPU and on GPUs without Transformer Engine, with or without SP.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lora.models.norm import RMSNorm


def local_layer_spec(num_experts: Optional[int] = None, moe_grouped_gemm: bool = False) -> ModuleSpec:
    """A TransformerLayer spec with local linears, SequentialMLP (or GroupedMLP) experts, RMSNorm."""
    spec = get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, normalization="RMSNorm"
    )
    # Copy, do not mutate: megatron's spec objects may be shared.
    submodules = dataclasses.replace(
        spec.submodules, input_layernorm=RMSNorm, pre_mlp_layernorm=RMSNorm
    )
    return dataclasses.replace(spec, submodules=submodules)


def local_block_spec(
    config: TransformerConfig, pp_rank: Optional[int] = None, moe_grouped_gemm: bool = False
) -> ModuleSpec:
    """A TransformerBlock spec for this pipeline stage's layers with an RMSNorm final norm."""
    layer = local_layer_spec(config.num_moe_experts, moe_grouped_gemm)
    num_layers = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=RMSNorm),
    )
