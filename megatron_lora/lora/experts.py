"""LoRA on the experts of a megatron-core MoE layer: one stacked adapter per expert linear.

    adapters = wrap_experts(layer.mlp.experts, AdapterConfig(rank=8, alpha=16),
                            prefix="decoder.layers.3.mlp.experts", seed_for=seed_for,
                            moe_layer=layer.mlp)            # [ExpertLora(fc1), ExpertLora(fc2)]

For each target (linear_fc1, linear_fc2) one `ExpertLora` (lora/expert_lora.py) holds the
factors of all local experts, stacked ([E_local, r, in], [E_local, out, r]); it is registered as
`experts.adapters.{target}`. Expert g's pair is named `{prefix}.{g}.{target}` and initialised
from `seed_for(that name)` and its config, so it is the same pair whatever EP, expert-TP, PP or
dispatcher (the global layout of each pair is in expert_lora.py).

Where the experts run:
- GroupedExperts (models/grouped_experts.py) reads `experts.adapters` and adds each adapter's
  term with one grouped matmul per factor over all local experts.
- megatron's SequentialMLP calls its experts' MLPs one by one; each local expert's target linear
  is replaced by an `ExpertSlot` (no parameters): its base output plus that expert's term, from
  per-expert views of the stacked factors made once per experts call.
Both keep SequentialMLP's module tree (`local_experts.{i}.linear_fc1` answers for its base) and
checkpoint format: each slot writes its expert's slice of the stacked tensors exactly as a
per-expert adapter did (ShardedTensors keyed by global expert index through SequentialMLP's
expert axis), and the experts module's sharded_state_dict gathers a factor's slices into one
entry under the stacked parameter's name (checkpoint.stacked_expert_entry), so adapter
checkpoints stay layout-invariant and load across this change.

Gradients are reduced over the expert-data-parallel group (`allreduce = False`) by megatron DDP.
Dropout: given the MoELayer (`moe_layer=`), each row's global token index is carried through the
layer's dispatcher (token_route.py), so the masks are the same at every layout and dispatcher.
"""

from __future__ import annotations

import weakref
from typing import Callable, List, Optional, Sequence, Union

import torch

from megatron_lora.lora import dora as D
from megatron_lora.lora.checkpoint import (accept_unwrapped_keys, linear_factor_entries,
                                           stacked_expert_entry, with_dp_cp_group)
from megatron_lora.lora.config import AdapterConfig
from megatron_lora.lora.expert_lora import ExpertLora
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


class ExpertSlot(torch.nn.Module):
    """Local expert `local`'s linear inside an experts module whose adapters are an ExpertLora:
    forward(x [n, in_local]) -> (base output + that expert's LoRA term, bias), as the base
    returns them. No parameters of its own; `base_layer` is the expert's linear."""

    def __init__(self, base_layer: torch.nn.Module, lora: ExpertLora, local: int):
        super().__init__()
        self.base_layer = base_layer
        self.__dict__["lora"] = lora  # not a submodule: the experts module owns it
        self.local = local
        # (key, int64 [rows] global token indices) of this expert's rows for dropout, set by
        # token_route.attach_token_route; None: no route (dropout then refused).
        self.dropout_rows = None
        accept_unwrapped_keys(self)

    @property
    def lora(self) -> ExpertLora:
        return self.__dict__["lora"]

    @property
    def global_name(self) -> str:
        """This expert's adapter name, e.g. "decoder.layers.3.mlp.experts.5.linear_fc1"."""
        return self.lora.names[self.local]

    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return getattr(self.base_layer, "bias", None)

    def drop(self, x: torch.Tensor):
        """(p, key, token ids) of this forward's dropout for these rows."""
        p = self.lora.dropout()
        if p == 0.0:
            return None
        if self.dropout_rows is None:
            raise RuntimeError(
                f"{self.lora.names[self.local]}: expert LoRA dropout needs the layer's token "
                "route; wrap the experts with wrap_experts(..., moe_layer=layer)")
        key, ids = self.dropout_rows(x)
        return p, key, ids

    def forward(self, x: torch.Tensor, *args, **kwargs):
        output, bias = self.base_layer(x, *args, **kwargs)
        lora = self.lora
        if not lora.active():
            return output, bias
        drop = self.drop(x)
        if lora.magnitude is not None:
            scale = lora.call_dora_scales()[self.local]
            return lora.expert_dora(
                self.local, x, output, scale, lambda d: self.base_layer(d, *args, **kwargs)[0],
                D.added_bias(self, bias), drop), bias
        return lora.expert_term(self.local, x, add_to=output, drop=drop), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The base's own entries (unchanged keys), plus this expert's slices of the stacked
        tensors laid out as a per-expert adapter's (the experts module stacks them again)."""
        metadata = with_dp_cp_group(metadata)
        state = self.base_layer.sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets,
                                                   metadata=metadata)
        view = self.lora.expert(self.local)
        factors = {"lora_A": view.lora_A, "lora_B": view.lora_B}
        if view.magnitude is not None:
            factors[D.MAGNITUDE] = view.magnitude
        state.update(linear_factor_entries(self.lora.geometry, factors, D.MAGNITUDE, prefix,
                                           sharded_offsets, metadata))
        return state

    def extra_repr(self) -> str:
        return f"expert {self.lora.first_expert + self.local} of {self.lora.names[0]}"


def _stacked_entries(experts_module: torch.nn.Module, state: dict, prefix: str) -> dict:
    """Replace the slots' per-expert adapter entries by one entry per stacked tensor, under the
    stacked parameter's name (what megatron's checkpointing matches to the parameter)."""
    for kind, lora in experts_module.adapters.items():
        for name, param in lora.named_parameters(recurse=False):
            keys = [f"{prefix}local_experts.{e}.{kind}.{name}" for e in range(lora.num_experts)]
            entries = [state.pop(key) for key in keys]
            state[f"{prefix}adapters.{kind}.{name}"] = stacked_expert_entry(entries, param)
    return state


def _attach(experts_module: torch.nn.Module, adapters: List[ExpertLora]) -> None:
    """Wrap this experts instance's forward (each adapter's per-call views) and
    sharded_state_dict (stacked entries); nothing in megatron is patched."""
    ref = weakref.ref(experts_module)
    # The token route's wrapper when there is one (it holds weak references only), else the
    # class's forward, looked up at call time: a bound method here would keep the module alive.
    routed = experts_module.__dict__.get("forward")

    def forward(*args, **kwargs):
        experts = ref()
        for lora in experts.adapters.values():
            lora.open_call()
        try:
            if routed is not None:
                return routed(*args, **kwargs)
            return type(experts).forward(experts, *args, **kwargs)
        finally:
            for lora in experts.adapters.values():
                lora.close_call()

    def sharded_state_dict(prefix: str = "", sharded_offsets=(), metadata=None):
        experts = ref()
        state = type(experts).sharded_state_dict(experts, prefix, sharded_offsets, metadata)
        return _stacked_entries(experts, state, prefix)

    experts_module.forward = forward
    experts_module.sharded_state_dict = sharded_state_dict


def wrap_experts(
    experts_module: torch.nn.Module,
    config: ConfigFor,
    *,
    prefix: str,
    seed_for: Callable[[str], int],
    targets: Sequence[str] = EXPERT_TARGETS,
    freeze_base: bool = True,
    moe_layer: Optional[torch.nn.Module] = None,
) -> List[ExpertLora]:
    """Give every local expert's target linears of a SequentialMLP (or GroupedExperts) LoRA, one
    stacked ExpertLora per target, in place.

    experts_module: megatron-core SequentialMLP or a subclass (`local_experts` of MLPs,
        `ep_group`, `num_local_experts`).
    config: one AdapterConfig for all, or config(name) -> AdapterConfig per expert adapter
        (ranks and scales may differ per expert, e.g. from a rank or alpha pattern; dropout,
        dtype and DoRA are one per target).
    prefix: the GLOBAL name of the experts module, e.g. "decoder.layers.3.mlp.experts"; expert
        adapter names are f"{prefix}.{global_expert}.{target}".
    seed_for: name -> seed; called once per expert adapter with that global name.
    moe_layer: the megatron MoELayer owning experts_module; required when any adapter has
        dropout > 0: its dispatcher then carries each row's global token index to the experts
        (token_route.py), which makes the dropout masks layout-independent.
    Returns the new ExpertLora modules in target order. Everything is validated (types, targets,
    expert count, every global expert's config against its linear) before the first module is
    changed; no collective is issued, except DoRA's magnitude initialisation (fc2 under
    expert-TP: an all-reduce of each expert's row norms).
    """
    from megatron.core.transformer.moe.experts import SequentialMLP

    if not isinstance(experts_module, SequentialMLP):
        raise UnsupportedBaseLayerError(
            f"wrap_experts needs a megatron-core SequentialMLP (or GroupedExperts), got "
            f"{type(experts_module).__name__}"
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
    if "adapters" in experts_module._modules:
        raise ValueError(f"{prefix} already has expert adapters; wrap all its targets in one call")

    # Every rank validates the configs of ALL global experts (not only its own), so that a
    # problem with one expert (e.g. a rank pattern) raises the same error on every rank.
    ep_rank, ep_size, num_local = expert_placement(experts_module)
    first = experts_module.local_experts[0]
    limits = {}
    for target in targets:
        base = getattr(first, target)
        if isinstance(base, ExpertSlot):
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
    for target in targets:
        for what in ("dropout", "dtype", "use_dora"):
            values = {str(getattr(cfg, what)) for name, cfg in configs.items()
                      if name.endswith(f".{target}")}
            if len(values) > 1:
                raise ValueError(
                    f"{prefix}: every expert's {target} adapter must have the same {what} (the "
                    f"experts' factors are one stacked tensor), got {sorted(values)}")
    any_dropout = any(cfg.dropout > 0.0 for cfg in configs.values())
    if any_dropout and moe_layer is None:
        raise ValueError(
            f"{prefix}: expert LoRA dropout > 0 needs moe_layer= (the MoELayer owning these "
            "experts), whose dispatcher carries each token's global index to the experts"
        )
    for mlp in experts_module.local_experts:
        for target in targets:
            describe_base_layer(getattr(mlp, target))  # every local linear is one we can wrap

    first_expert = ep_rank * num_local
    adapters = []
    for target in targets:
        names = [f"{prefix}.{first_expert + e}.{target}" for e in range(num_local)]
        bases = [getattr(mlp, target) for mlp in experts_module.local_experts]
        adapters.append(ExpertLora(target, bases, [configs[n] for n in names],
                                   [int(seed_for(n)) for n in names], names=names,
                                   first_expert=first_expert, freeze_base=freeze_base))
    experts_module.adapters = torch.nn.ModuleDict({ad.kind: ad for ad in adapters})
    slots = [[] for _ in range(num_local)]
    for ad, target in zip(adapters, targets):
        for e, mlp in enumerate(experts_module.local_experts):
            slot = ExpertSlot(getattr(mlp, target), ad, e)
            setattr(mlp, target, slot)
            slots[e].append((slot, EXPERT_TARGETS.index(target)))
    if moe_layer is not None:
        from megatron_lora.lora.token_route import attach_token_route

        experts_ref = weakref.ref(experts_module)

        def needs_route() -> bool:  # identical on every rank: all global configs, train mode
            experts = experts_ref()
            return any_dropout and experts is not None and experts.training

        attach_token_route(moe_layer, experts_module, slots, needs_route)
    _attach(experts_module, adapters)
    return adapters


__all__ = ["EXPERT_TARGETS", "ExpertLora", "ExpertSlot", "expert_placement", "global_expert_index",
           "wrap_experts"]
