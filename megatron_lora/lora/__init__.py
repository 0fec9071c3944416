"""LoRA adapters for megatron-core tensor-parallel linears (exact under TP and SP).

Public API:
    AdapterConfig        layer-level hyper-parameters (rank, alpha, dropout, rsLoRA, init, dtype)
    LoraAdapter          wraps a ColumnParallelLinear / RowParallelLinear (or a TE-style linear
                         with parallel_mode 'column'/'row'); returns (output, bias) like the base
    describe_base_layer  the base's LinearGeometry (mode, global sizes, group, SP flags)
    init_global_factors  the global A, B a seed gives (the same at every layout)
    keep_mask / draw_dropout_key   the layout-independent dropout mask and its key
    lora_down            the down-projection autograd op (dropout + scale, lean backward)
See docs/lora.md.
"""

from megatron_lora.lora.adapter import LoraAdapter, init_global_factors
from megatron_lora.lora.config import AdapterConfig
from megatron_lora.lora.dropout import draw_dropout_key, keep_mask
from megatron_lora.lora.parallel import (
    COLUMN,
    ROW,
    LinearGeometry,
    UnsupportedBaseLayerError,
    describe_base_layer,
)
from megatron_lora.lora.projection import lora_down

__all__ = [
    "AdapterConfig",
    "COLUMN",
    "LinearGeometry",
    "LoraAdapter",
    "ROW",
    "UnsupportedBaseLayerError",
    "describe_base_layer",
    "draw_dropout_key",
    "init_global_factors",
    "keep_mask",
    "lora_down",
]
