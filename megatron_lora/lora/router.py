"""LoRA on the MoE router gate (megatron-core TopKRouter): logits = x W^T + scale * x A^T B^T.

    adapter = wrap_router(layer.mlp.router, AdapterConfig(rank=4, alpha=8), seed=seed)

Global layout (h hidden, E experts): A [r, h], B [E, r], both replicated everywhere, like the
router weight W [E, h]. The adapter is registered as the router's child `lora` (state keys
`...mlp.router.lora.lora_A` / `lora_B`) and the router's `gating` is redirected to it on this
instance only, so routing, top-k, the load-balancing aux loss and the dispatchers see the adapted
logits and nothing else in megatron changes.

Gradients are reduced exactly as the router weight's: the same `sequence_parallel` attribute
(megatron sets it to config.sequence_parallel: under SP each TP rank routes its own sequence
shard, the partial gradients are summed over the dense TP group by finalize_model_grads) and the
dense data-parallel group (`allreduce = True`). No collective on the LoRA path.

The input is the router's: [s/t, b, h] under SP (this rank's sequence shard), else [s, b, h]. u =
x A^T is computed in the activation dtype; the up-projection runs in the router dtype
(moe_router_dtype, fp32 for Mixtral) like the gate itself.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from megatron_lora.lora.factors import init_global_factors, up_projection
from megatron_lora.lora.checkpoint import factor_sharded_tensors, with_dp_cp_group
from megatron_lora.lora.config import AdapterConfig
from megatron_lora.lora.dropout import draw_dropout_key
from megatron_lora.lora.merge import WeightDeltaMerge
from megatron_lora.lora.parallel import UnsupportedBaseLayerError
from megatron_lora.lora.projection import lora_down


class RouterLora(WeightDeltaMerge, torch.nn.Module):
    """The router's LoRA pair; see the module docstring for layout and reductions.

    lora_A [r, h], lora_B [E, r] (global = local). forward(input_, logits) -> adapted logits
    [tokens, E] in the logits' dtype.
    """

    dropout_stream: Optional[int] = None  # as LoraAdapter's (set by apply_lora)

    def __init__(self, router: torch.nn.Module, config: AdapterConfig, *, seed: int):
        super().__init__()
        weight = router.weight
        num_experts, hidden = weight.shape
        self.config = config
        self.scaling = config.scaling
        self.merged = False
        self._disabled = False
        # A weak reference: the router owns this module, and a strong back-reference would make
        # a cycle that keeps the router (and its process groups) alive until a gc pass.
        self._router = weakref.ref(router)
        a, b = init_global_factors(config, hidden, num_experts, seed)
        dtype = config.dtype or weight.dtype
        self.lora_A = torch.nn.Parameter(a.to(device=weight.device, dtype=dtype))
        self.lora_B = torch.nn.Parameter(b.to(device=weight.device, dtype=dtype))
        for p in (self.lora_A, self.lora_B):
            p.sequence_parallel = bool(getattr(weight, "sequence_parallel", False))
            p.allreduce = True
            p.tensor_model_parallel = False
            p.partition_dim = -1
            p.partition_stride = 1

    @property
    def router(self):
        router = self._router()
        if router is None:
            raise RuntimeError("RouterLora: its router no longer exists")
        return router

    def forward(self, input_: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if self.merged or self._disabled:
            return logits
        router = self.router
        p = self.config.dropout if self.training else 0.0
        key = draw_dropout_key(input_.device, self.dropout_stream) if p > 0.0 else None
        offset = 0
        if bool(getattr(router.config, "sequence_parallel", False)):
            # This rank's tokens start at tp_rank * local tokens of the global sequence.
            tp = router.tp_group
            offset = tp.rank() * (input_.numel() // input_.shape[-1])
        u = lora_down(input_, self.lora_A, self.scaling, p, key, offset, 0)
        return up_projection(u.to(logits.dtype), self.lora_B, logits)

    def delta_weight(self) -> torch.Tensor:
        """scale * B @ A, fp32 [E, h] (the router weight's shape; global = local)."""
        return torch.matmul(self.lora_B.detach().float(), self.lora_A.detach().float()) * self.scaling

    def _merge_target(self) -> torch.Tensor:
        return self.router.weight

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """lora_A / lora_B replicated (over the dense TP group, like the router weight)."""
        metadata = with_dp_cp_group(metadata)
        return factor_sharded_tensors(
            {"lora_A": self.lora_A, "lora_B": self.lora_B}, prefix, {}, sharded_offsets,
            metadata, self.router.tp_group,
        )


def _gating_with_lora(router, adapter: RouterLora):
    base_gating = type(router).gating

    # Captures the adapter only (it reaches the router through its weak reference): the router
    # holds this function, so capturing the router itself would be a reference cycle.
    def gating(input_):
        return adapter(input_, base_gating(adapter.router, input_))

    return gating


def wrap_router(
    router_module: torch.nn.Module, config: AdapterConfig, *, seed: int, freeze_base: bool = True
) -> RouterLora:
    """Attach a RouterLora to a megatron Router (TopKRouter) in place and return it.

    Raises (locally, before any collective) UnsupportedBaseLayerError when `router_module` is not
    a megatron router (e.g. the model has no MoE layer: router is None), ValueError when the rank
    exceeds min(hidden, num_experts) or the router is already wrapped.
    """
    from megatron.core.transformer.moe.router import Router

    if not isinstance(router_module, Router):
        raise UnsupportedBaseLayerError(
            "router LoRA needs a megatron-core MoE router (TopKRouter); got "
            f"{type(router_module).__name__}: this layer has no router (dense MLP?)"
        )
    if not isinstance(config, AdapterConfig):
        raise TypeError(f"config must be an AdapterConfig, got {type(config).__name__}")
    num_experts, hidden = router_module.weight.shape
    if config.rank > min(num_experts, hidden):
        raise ValueError(
            f"AdapterConfig.rank={config.rank} is larger than min(hidden, num_experts) = "
            f"min({hidden}, {num_experts}) of the router gate"
        )
    if isinstance(getattr(router_module, "lora", None), RouterLora):
        raise ValueError("the router is already wrapped")
    adapter = RouterLora(router_module, config, seed=seed)
    router_module.add_module("lora", adapter)
    router_module.gating = _gating_with_lora(router_module, adapter)
    if freeze_base:
        for p in router_module.parameters(recurse=False):
            p.requires_grad_(False)
    return adapter


__all__ = ["RouterLora", "wrap_router"]
