"""LoRA adapters for megatron-core tensor-parallel linears (exact under TP and SP).

Public API:
    AdapterConfig        layer-level hyper-parameters (rank, alpha, dropout, rsLoRA, init, dtype)
    LoraAdapter          wraps a ColumnParallelLinear / RowParallelLinear (or a TE-style linear
                         with parallel_mode 'column'/'row'); returns (output, bias) like the base
    describe_base_layer  the base's LinearGeometry (mode, global sizes, group, SP flags)
    init_global_factors  the global A, B a seed gives (the same at every layout)
    keep_mask / draw_dropout_key   the layout-independent dropout mask and its key
    lora_down            the down-projection autograd op (dropout + scale, lean backward)
MoE / vocabulary (docs/lora.md, "MoE, router, embedding and output layer"):
    wrap_experts         LoRA on an MoE layer's experts: one ExpertLora per fc1 / fc2, the
                         local experts' factors stacked (global expert names and seeds)
    ExpertLora           those stacked adapters (grouped matmuls over the experts' rows)
    wrap_router          RouterLora on a TopKRouter gate
    wrap_embedding       EmbeddingLora on a VocabParallelEmbedding
    wrap_output_layer    LoraAdapter on the column-parallel output layer (own or tied weight)
    global_factors       an adapter's global (A, B) from the shards (undoes a partition stride)
See docs/lora.md.
"""

from megatron_lora.lora.adapter import LoraAdapter
from megatron_lora.lora.factors import init_global_factors
from megatron_lora.lora.config import AdapterConfig
from megatron_lora.lora.dropout import draw_dropout_key, keep_mask
from megatron_lora.lora.parallel import (
    COLUMN,
    ROW,
    LinearGeometry,
    UnsupportedBaseLayerError,
    describe_base_layer,
)
from megatron_lora.lora.embedding import EmbeddingLora, wrap_embedding, wrap_output_layer
from megatron_lora.lora.gather import global_factors
from megatron_lora.lora.experts import (EXPERT_TARGETS, ExpertLora, global_expert_index,
                                        wrap_experts)
from megatron_lora.lora.grouped import grouped_linear
from megatron_lora.lora.projection import lora_down
from megatron_lora.lora.router import RouterLora, wrap_router

__all__ = [
    "AdapterConfig",
    "COLUMN",
    "EXPERT_TARGETS",
    "EmbeddingLora",
    "ExpertLora",
    "RouterLora",
    "global_expert_index",
    "global_factors",
    "grouped_linear",
    "wrap_embedding",
    "wrap_experts",
    "wrap_output_layer",
    "wrap_router",
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
