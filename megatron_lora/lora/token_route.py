"""Each dispatched expert row's global token index, for layout-independent expert dropout.

Inside an expert the rows are the dispatcher's permuted tokens: their order depends on EP,
expert-TP, TP and the dispatcher. A dropout mask of (key, global token, global feature) needs
each row's global token index: micro-batch * tokens per micro-batch + its position in the
micro-batch's [s, b], flattened sequence-major (under SP this rank's tokens start at tp_rank *
local tokens, as for the dense adapters); the micro-batch is the global one of the rank that sent
the row (lora/dropout.py: micro_batch_keying; 0 outside a training step), since under EP an
expert receives rows of other data-parallel replicas' micro-batches. `attach_token_route(moe_layer, experts, adapters)` sends that index through the
layer's own dispatcher, on this layer instance only (nothing in megatron is patched):

- the dispatcher's `dispatch_preprocess` is wrapped on the instance. When the experts train with
  dropout it first takes the layer's dropout key (the iteration's, for the experts' stream, in a
  training step; else one draw), then runs the (position, micro-batch) tensor ([local tokens, 2],
  fp32: each exact below 2^24) through the dispatcher's own public pipeline,
  dispatch_preprocess -> token_dispatch -> dispatch_postprocess, on a shallow copy of the
  dispatcher (same groups and config, its own per-call state, so the real dispatch is untouched);
  the result lines up with the experts' input rows;
- the SequentialMLP's `forward` is wrapped on the instance: it splits the indices by
  tokens_per_expert and hands each local expert's ExpertSlots (key stream 2 e + j, dropout.sub_key)
  their rows for that call (grouped experts, models/grouped_experts.py, read the whole call's
  indices and key from `experts.token_route`).

Cost, only in training with dropout > 0 on the layer's experts: one more dispatch of a
[tokens, 2] fp32 tensor (8 bytes per token and expert slot), which through megatron's public
pipeline also moves that dispatch's probabilities and metadata again: allgather dispatcher
(over the TP x EP group) the routing map and probs, [T, E] x (1 + 4) bytes gathered;
alltoall dispatcher 4 bytes of probs per slot and its token-count exchange. Forward only, no
backward traffic. With dropout 0 (or in eval) nothing runs.

megatron internals relied on (megatron-core 0.16): MoELayer.token_dispatcher and the
dispatcher's dispatch_preprocess(hidden, routing_map, probs) / token_dispatch(hidden, probs) /
dispatch_postprocess(hidden, probs) -> (rows, tokens_per_expert, probs); SequentialMLP.forward(
rows, tokens_per_expert, probs) calling local_experts in order on splits of tokens_per_expert.
Tested with the allgather and alltoall dispatchers (the flex dispatcher has the same pipeline,
untested). Not supported, with dropout > 0 only: quantisation padding of expert inputs (fp8 /
fp4: raises), capacity-factor drop-and-pad (padded rows would get index 0), and schedules that
interleave one micro-batch's dispatch with another's expert compute (the route holds one
forward's indices at a time).
"""

from __future__ import annotations

import copy
import weakref
from typing import List, Optional

import torch

from megatron_lora.lora.dropout import draw_dropout_key, expert_keys, micro_batch_keying

_EXACT_FP32 = 2**24


class TokenRoute:
    """The per-forward state shared by a layer's dispatcher wrapper and its experts wrapper."""

    def __init__(self, num_local_experts: int, first_expert: int):
        self.num_local = num_local_experts
        self.first_expert = first_expert
        self.key: Optional[torch.Tensor] = None
        self.stream: Optional[int] = None  # the experts' dropout key stream (set by apply_lora)
        self.ids: Optional[torch.Tensor] = None  # int64 [rows], dispatcher order
        self.split: Optional[List[torch.Tensor]] = None  # per local expert, this call

    def rows_for(self, local: int, stream_offset: int, n_rows: int):
        """(key of expert `local`'s stream, int64 [n_rows] global token indices) for the
        current experts call; stream_offset 0 for fc1, 1 for fc2."""
        if self.split is None or self.key is None:
            raise RuntimeError(
                "expert LoRA dropout: no global token indices for this forward. The experts "
                "module must run inside its MoELayer, whose dispatcher was attached by "
                "wrap_experts(..., moe_layer=layer)"
            )
        rows = self.split[local]
        if rows.numel() != n_rows:
            raise RuntimeError(
                f"expert LoRA dropout: expert {self.first_expert + local} got {n_rows} rows but "
                f"the dispatcher routed {rows.numel()} (padded expert inputs are not supported)"
            )
        return expert_keys(self.key, self.first_expert + local, 1, stream_offset)[0], rows


def local_token_index(moe_layer, hidden_states: torch.Tensor) -> torch.Tensor:
    """int64 [local tokens]: global index, in this replica's [s, b], of this rank's tokens."""
    n = hidden_states.numel() // hidden_states.shape[-1]
    offset = 0
    if bool(getattr(moe_layer.config, "sequence_parallel", False)):
        tp = moe_layer.router.tp_group  # the dense TP group the sequence is sharded over
        offset = tp.rank() * n
    return torch.arange(offset, offset + n, dtype=torch.int64, device=hidden_states.device)


def dispatch_token_index(dispatcher, hidden_states, routing_map, probs, index,
                         micro_batch: int = 0, tokens_per_micro_batch: int = 0) -> torch.Tensor:
    """`index` (int64 [local tokens], positions in this micro-batch) through `dispatcher`'s
    pipeline, on a shallow copy of it: int64 [rows], the global token index of each row the
    experts receive, in their order: micro_batch * tokens_per_micro_batch + position, where
    `micro_batch` is the sending rank's global micro-batch (under EP an expert receives rows of
    other replicas' micro-batches). (position, micro_batch) travel as two fp32 columns, each
    exact below 2^24."""
    twin = copy.copy(dispatcher)
    twin.__dict__.pop("dispatch_preprocess", None)  # the instance wrapper: use the class method
    if hasattr(twin, "shared_experts"):
        twin.shared_experts = None  # no shared-expert side work for the index
    if micro_batch >= _EXACT_FP32:
        raise ValueError(f"expert LoRA dropout: micro-batch index {micro_batch} exceeds 2^24")
    values = torch.stack([index.to(torch.float32), torch.full_like(index, micro_batch,
                                                                   dtype=torch.float32)], dim=-1)
    values = values.reshape(tuple(hidden_states.shape[:-1]) + (2,))
    with torch.no_grad():
        h, p = twin.dispatch_preprocess(values, routing_map, probs.detach())
        h, p = twin.token_dispatch(h, p)
        rows, _, _ = twin.dispatch_postprocess(h, p)
    rows = rows.reshape(-1, 2).round().to(torch.int64)
    return rows[:, 1] * int(tokens_per_micro_batch) + rows[:, 0]


def attach_token_route(moe_layer, experts_module, adapters, needs_route) -> TokenRoute:
    """Wrap `moe_layer.token_dispatcher.dispatch_preprocess` and `experts_module.forward` on
    these instances (see the module docstring); `adapters[local]` are local expert `local`'s
    ExpertSlots (lora/experts.py) as (slot, stream_offset) pairs; needs_route() -> bool decides
    per forward (the same on every rank: it depends on the configs of all global experts and
    train mode)."""
    from megatron_lora.lora.placement import expert_placement

    ep_rank, _, num_local = expert_placement(experts_module)
    route = TokenRoute(num_local, ep_rank * num_local)
    dispatcher = moe_layer.token_dispatcher
    # Weak references: the layer owns the dispatcher and the experts, which hold these wrappers;
    # strong ones would be reference cycles keeping the layer (and its groups) alive until gc.
    layer_ref, dispatcher_ref, experts_ref = (
        weakref.ref(moe_layer), weakref.ref(dispatcher), weakref.ref(experts_module))
    if "dispatch_preprocess" in dispatcher.__dict__:
        raise ValueError("the MoE layer's token dispatcher already carries a token route")
    base_preprocess = type(dispatcher).dispatch_preprocess

    def dispatch_preprocess(hidden_states, routing_map, probs, *args, **kwargs):
        route.key = route.ids = route.split = None
        if needs_route():
            layer = layer_ref()
            index = local_token_index(layer, hidden_states)
            bound = (index.numel() * layer.router.tp_group.size()
                     if bool(getattr(layer.config, "sequence_parallel", False)) else index.numel())
            if bound > _EXACT_FP32:
                raise ValueError(
                    f"expert LoRA dropout: {bound} tokens per micro-batch exceed the 2^24 that "
                    "the fp32 token index carries exactly"
                )
            keying = (None if route.stream is None
                      else micro_batch_keying(hidden_states.device, route.stream))
            if keying is None:  # outside a training step: one drawn key, this call's tokens
                route.key, micro_batch = draw_dropout_key(hidden_states.device), 0
            else:  # the iteration's key; rows told apart by their global token index
                route.key, micro_batch = keying
            route.ids = dispatch_token_index(
                dispatcher_ref(), hidden_states, routing_map, probs, index, micro_batch, bound)
        return base_preprocess(dispatcher_ref(), hidden_states, routing_map, probs, *args,
                               **kwargs)

    base_forward = type(experts_module).forward

    def forward(permuted_hidden, tokens_per_expert, *args, **kwargs):
        if route.ids is not None:
            if route.ids.numel() != permuted_hidden.shape[0]:
                raise RuntimeError(
                    f"expert LoRA dropout: {route.ids.numel()} routed token indices for "
                    f"{permuted_hidden.shape[0]} expert rows"
                )
            counts = [int(c) for c in tokens_per_expert.tolist()]
            route.split = list(torch.split(route.ids, counts))
        try:
            return base_forward(experts_ref(), permuted_hidden, tokens_per_expert, *args, **kwargs)
        finally:
            route.split = None

    dispatcher.dispatch_preprocess = dispatch_preprocess
    experts_module.forward = forward
    experts_module.token_route = route  # grouped experts read the whole call's rows and key
    for local, pairs in enumerate(adapters):
        for adapter, stream_offset in pairs:
            adapter.dropout_rows = _rows_source(route, local, stream_offset)
    return route


def _rows_source(route: TokenRoute, local: int, stream_offset: int):
    def rows(input_: torch.Tensor):
        return route.rows_for(local, stream_offset, input_.numel() // input_.shape[-1])

    return rows


__all__ = ["TokenRoute", "attach_token_route", "dispatch_token_index", "local_token_index"]
