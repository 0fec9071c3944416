"""Per-expert LoRA on megatron-core SequentialMLP experts (one adapter pair per global expert).

    adapters = wrap_experts(layer.mlp.experts, AdapterConfig(rank=8, alpha=16),
                            prefix="decoder.layers.3.mlp.experts", seed_for=seed_for,
                            moe_layer=layer.mlp)

Each local expert's `linear_fc1` / `linear_fc2` is replaced in place by a `LoraAdapter`. The
adapter of global expert e (e = ep_rank * num_local_experts + local index) is named
`{prefix}.{e}.{target}` and initialised from `seed_for(that name)`, so expert e's (A_e, B_e) is
the same pair whatever EP, expert-TP, PP or dispatcher: those change where it lives, never what it
is.

Global factor layout of expert e (h hidden, f the expert ffn size, g = 2 for gated units else 1,
t = expert-TP size; sharding over the expert-TP group, experts over the EP group):
    linear_fc1: A_e [r, h] replicated over expert-TP;
                B_e [g*f, r] global rows [gate; up] like the weight, rank k holds
                [gate rows k*f/t:(k+1)*f/t ; up rows k*f/t:(k+1)*f/t] (partition stride g)
    linear_fc2: A_e [r, f] sharded on dim 1 (rank k: columns k*f/t:(k+1)*f/t);
                B_e [h, r] replicated over expert-TP
Update: W_e += (alpha/r) B_e A_e, W_e the global [out, in] weight of that linear.

Inside an expert the input is [tokens_e, h] (the dispatcher's permuted tokens for expert e,
identical on every expert-TP rank), the fc1 output [tokens_e, g*f/t], the fc2 output a partial
sum [tokens_e, h] that the dispatcher reduces. The LoRA path adds no activation collective; the
replicated factor's partial gradient is summed over expert-TP inside autograd (adapter.py).
Gradients are reduced over the expert-data-parallel group (`allreduce = False`) by megatron DDP.
Dropout: given the MoELayer (`moe_layer=`), each row's global token index is carried through the
layer's dispatcher (token_route.py), so the masks are the same at every layout and dispatcher.
Checkpoints: SequentialMLP.sharded_state_dict hands each expert a global-expert axis offset, so
`...experts.linear_fc1.lora_A` is one ShardedTensor [E, r, h] keyed by global expert index.
"""

from __future__ import annotations

import weakref
from typing import Callable, List, Optional, Sequence, Union

import torch

from megatron_lora.lora.adapter import LoraAdapter
from megatron_lora.lora.config import AdapterConfig
from megatron_lora.lora.parallel import UnsupportedBaseLayerError, describe_base_layer
from megatron_lora.lora.placement import expert_placement, global_expert_index

EXPERT_TARGETS = ("linear_fc1", "linear_fc2")
ConfigFor = Union[AdapterConfig, Callable[[str], AdapterConfig]]


def _config_for(config: ConfigFor, name: str) -> AdapterConfig:
    cfg = config(name) if callable(config) and not isinstance(config, AdapterConfig) else config
    if not isinstance(cfg, AdapterConfig):
        raise TypeError(
            f"config must be an AdapterConfig (or a function of the adapter name returning one), "
            f"got {type(cfg).__name__} for {name}"
        )
    return cfg


def check_targets(targets: Sequence[str]) -> tuple:
    targets = tuple(targets)
    bad = [t for t in targets if t not in EXPERT_TARGETS]
    if not targets or bad:
        raise ValueError(
            f"targets must be a non-empty subset of {EXPERT_TARGETS}, got {list(targets)}"
        )
    return targets


def check_expert_count(experts: torch.nn.Module) -> None:
    """The experts module agrees with its config and the EP group (before any collective)."""
    _, ep_size, num_local = expert_placement(experts)
    total = getattr(getattr(experts, "config", None), "num_moe_experts", None)
    if num_local < 1:
        raise ValueError(f"experts module holds num_local_experts={num_local}; need >= 1")
    if total is not None and num_local * ep_size != total:
        raise ValueError(
            f"expert count does not fit the layout: num_local_experts={num_local} x EP size "
            f"{ep_size} != num_moe_experts={total}"
        )


def wrap_experts(
    experts_module: torch.nn.Module,
    config: ConfigFor,
    *,
    prefix: str,
    seed_for: Callable[[str], int],
    targets: Sequence[str] = EXPERT_TARGETS,
    freeze_base: bool = True,
    moe_layer: Optional[torch.nn.Module] = None,
) -> List[LoraAdapter]:
    """Wrap every local expert's target linears of a SequentialMLP in place.

    experts_module: megatron-core SequentialMLP (`local_experts` of MLPs, `ep_group`,
        `num_local_experts`). GroupedMLP is not wrapped in place; grouped.GroupedExpertLora
        computes the same adapters for a grouped path that calls it.
    config: one AdapterConfig for all, or config(name) -> AdapterConfig per adapter (ranks may
        differ per expert, e.g. from a rank pattern).
    prefix: the GLOBAL name of the experts module, e.g. "decoder.layers.3.mlp.experts"; adapter
        names are f"{prefix}.{global_expert}.{target}".
    seed_for: name -> seed; called once per adapter with that global name.
    moe_layer: the megatron MoELayer owning experts_module; required when any adapter has
        dropout > 0: its dispatcher then carries each row's global token index to the experts
        (token_route.py), which makes the dropout masks layout-independent.
    Returns the new adapters in (local expert, target) order; each has `.global_name` and
    `.global_expert`. Everything is validated (types, targets, expert count, every rank against
    its linear) before the first module is replaced; no collective is issued.
    """
    from megatron.core.transformer.moe.experts import SequentialMLP

    if not isinstance(experts_module, SequentialMLP):
        raise UnsupportedBaseLayerError(
            f"wrap_experts needs a megatron-core SequentialMLP, got "
            f"{type(experts_module).__name__} (GroupedMLP: see grouped.GroupedExpertLora)"
        )
    if moe_layer is not None and getattr(moe_layer, "experts", None) is not experts_module:
        raise ValueError("moe_layer must be the MoELayer whose `experts` is experts_module")
    if moe_layer is not None and getattr(moe_layer, "token_dispatcher", None) is None:
        raise ValueError("moe_layer has no token_dispatcher; expert dropout needs one")
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"prefix must be the experts module's global name, got {prefix!r}")
    if not callable(seed_for):
        raise TypeError("seed_for must be a function name -> int")
    targets = check_targets(targets)
    check_expert_count(experts_module)

    # Every rank validates the configs of ALL global experts (not only its own), so that a
    # problem with one expert (e.g. a rank pattern) raises the same error on every rank.
    ep_rank, ep_size, num_local = expert_placement(experts_module)
    first = experts_module.local_experts[0]
    limits = {}
    for target in targets:
        base = getattr(first, target)
        if isinstance(base, LoraAdapter):
            raise ValueError(f"{prefix}.*.{target} is already wrapped")
        geometry = describe_base_layer(base)
        limits[target] = min(geometry.in_features, geometry.out_features)
    configs = {}
    for expert in range(ep_size * num_local):
        for target in targets:
            name = f"{prefix}.{expert}.{target}"
            cfg = _config_for(config, name)
            if cfg.rank > limits[target]:
                raise ValueError(
                    f"LoRA rank {cfg.rank} for {name} exceeds min(in_features, out_features) = "
                    f"{limits[target]}"
                )
            configs[name] = cfg
    any_dropout = any(cfg.dropout > 0.0 for cfg in configs.values())
    if any_dropout and moe_layer is None:
        raise ValueError(
            f"{prefix}: expert LoRA dropout > 0 needs moe_layer= (the MoELayer owning these "
            "experts), whose dispatcher carries each token's global index to the experts"
        )
    plan = []
    for local, mlp in enumerate(experts_module.local_experts):
        expert = ep_rank * num_local + local
        for target in targets:
            base = getattr(mlp, target)
            describe_base_layer(base)  # every local linear is one we can wrap
            name = f"{prefix}.{expert}.{target}"
            plan.append((mlp, target, base, name, expert, configs[name]))

    adapters = []
    for mlp, target, base, name, expert, cfg in plan:
        adapter = LoraAdapter(base, cfg, seed=int(seed_for(name)), freeze_base=freeze_base)
        adapter.global_name = name
        adapter.global_expert = expert
        setattr(mlp, target, adapter)
        adapters.append(adapter)
    if moe_layer is not None:
        from megatron_lora.lora.token_route import attach_token_route

        per_local = [[] for _ in range(num_local)]
        for adapter, (_, target, _, _, expert, _) in zip(adapters, plan):
            per_local[expert - ep_rank * num_local].append(
                (adapter, EXPERT_TARGETS.index(target)))
        experts_ref = weakref.ref(experts_module)

        def needs_route() -> bool:  # identical on every rank: all global configs, train mode
            experts = experts_ref()
            return any_dropout and experts is not None and experts.training

        attach_token_route(moe_layer, experts_module, per_local, needs_route)
    return adapters


__all__ = ["EXPERT_TARGETS", "expert_placement", "global_expert_index", "wrap_experts"]
