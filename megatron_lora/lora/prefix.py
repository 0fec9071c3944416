"""Prefix tuning (HF PEFT's PREFIX_TUNING) on megatron-core GPT models.

Every decoder layer gets `n = num_virtual_tokens` learned key/value pairs that every query of the
layer attends to, before its own (causal) keys: the prefix is visible to every sample of a packed
sequence and to every generated token, and nothing else in the model changes.

    prefix of layer l: P_l [n, 2, groups, head_dim]   (keys P_l[:, 0], values P_l[:, 1])
    without projection: P_l is a parameter (PEFT: embedding rows [n, L * 2 * groups * head_dim])
    with projection:    P_l = tanh(E W1^T + b1) W2_l^T + b2_l, E [n, td], W1 [enc, td], b1 [enc]
                        shared by all layers (td = groups * head_dim, PEFT's GQA token_dim),
                        W2_l [2 * td, enc], b2_l [2 * td] the layer's rows of PEFT's last Linear

Positions follow PEFT on transformers, where the prefix is a KV cache of length n: the prefix keys
carry no rotary embedding, and a sample's tokens sit at positions n, n + 1, ... (so a query
scores the prefix as transformers + PEFT score it). In a packed row each sample restarts at n:
its positions come from the block-diagonal attention mask (a row's visible keys minus one).

Parallel state of the parameters:
- P_l, W2_l, b2_l: sharded by query groups over TP like the base's keys and values (this rank's
  groups [k * g/t, (k+1) * g/t)); each pipeline stage holds its own layers'. Gradients are
  complete on each rank (a rank's heads alone read its groups), so no collective is added.
- E, W1, b1 (`prefix_encoder`, with projection): replicated on every TP rank and pipeline
  stage. Each rank's gradient holds only its own layers' and groups' part, so
  `reduce_shared_prefix_grads` sums them over the model-parallel (TP x PP) group once per step,
  after the backward passes (from training.step's finalize function); DP reduces as usual.
- Sequence parallelism does not reach the core attention (the sequence is gathered before it).

Collectives added: none in forward or backward; with projection one all-reduce of
n * td + enc * (td + 1) elements (E, W1, b1) over TP x PP per optimizer step.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule

from megatron_lora import runtime
from megatron_lora.lora.identity import adapter_seed, global_layer_prefix

# The attribute that marks the replicated projection parameters (summed over TP x PP).
SHARED = "prefix_shared"
ENCODER = "prefix_encoder"


class PrefixState:
    """What the layers of one model share during a forward: n, the positions of this forward's
    tokens (set by the model's forward pre-hook) and the prefixed masks (one object per
    micro-batch, so every layer reuses it, and SDPAttention's float mask cached on it)."""

    def __init__(self, num_virtual_tokens: int):
        self.n = num_virtual_tokens
        self.positions: Optional[torch.Tensor] = None  # [b or 1, s] int64, or None: 0 .. s - 1
        self._causal: Dict[tuple, torch.Tensor] = {}

    def begin(self, attention_mask: Optional[torch.Tensor]) -> None:
        """Before a model forward: positions from the packed-sample mask (None: unpacked)."""
        self.positions = None if attention_mask is None else positions_from_mask(attention_mask)

    def mask(self, attention_mask: Optional[torch.Tensor], sq: int, sk: int,
             device) -> torch.Tensor:
        """bool [b or 1, 1, sq, n + sk], True = masked: the prefix columns visible to every
        query, then `attention_mask` (or, when None, causal with the queries the last sq of the
        sk positions, as with a KV cache)."""
        n = self.n
        if attention_mask is not None:
            key = (n, sq, sk, attention_mask._version)
            cached = getattr(attention_mask, "_prefix_mask", None)
            if cached is not None and cached[0] == key:
                return cached[1]
            b = attention_mask.shape[0]
            visible = torch.zeros(b, 1, sq, n, dtype=torch.bool, device=attention_mask.device)
            out = torch.cat([visible, attention_mask.expand(b, 1, sq, sk)], dim=-1)
            attention_mask._prefix_mask = (key, out)
            return out
        key = (sq, sk, str(device))
        out = self._causal.get(key)
        if out is None:
            keep = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq)
            visible = torch.zeros(sq, n, dtype=torch.bool, device=device)
            out = torch.cat([visible, ~keep], dim=-1).view(1, 1, sq, n + sk)
            if len(self._causal) > 16:
                self._causal.clear()
            self._causal[key] = out
        return out


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, 1, s, s] bool (True = masked; block-diagonal causal, megatron_lora.data.packing) ->
    [b, s] int64: each token's position within its sample (visible keys minus one; padding,
    which sees itself alone, gets 0)."""
    return (~attention_mask[:, 0]).sum(-1) - 1


class PrefixRotary(torch.nn.Module):
    """Around megatron's RotaryEmbedding: the same table with every position moved by n (PEFT's
    positions after a prefix of n), per token when the forward's tokens carry positions of their
    own (packed samples): then [s, b or 1, 1, dim] instead of [s, 1, 1, dim]."""

    def __init__(self, base_layer: torch.nn.Module, state: PrefixState):
        super().__init__()
        self.base_layer = base_layer
        self._state = [state]  # a list: not a submodule

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:  # get_rotary_seq_len and the rest: the base's
            return getattr(self._modules["base_layer"], name)

    def forward(self, max_seq_len: int, offset: int = 0, *args, **kwargs):
        state = self._state[0]
        positions = state.positions
        if positions is None or positions.shape[-1] != max_seq_len:
            return self.base_layer(max_seq_len, offset + state.n, *args, **kwargs)
        # Packed positions restart at each sample, so they are below max_seq_len: the table of
        # max_seq_len rows holds them all (a row does not depend on the table's length), and no
        # host read of positions.max() is needed.
        table = self.base_layer(max_seq_len, offset + state.n, *args, **kwargs)
        emb = table[:, 0, 0][positions.to(table.device)]  # [b, s, dim]
        return emb.transpose(0, 1).unsqueeze(2)  # [s, b, 1, dim]


def _tp():
    group = parallel_state.get_tensor_model_parallel_group()
    return group.size(), group.rank()


def _uniform(shape, bound: float, generator) -> torch.Tensor:
    return (torch.rand(shape, generator=generator, dtype=torch.float64, device="cpu") * 2 - 1) * bound


def _shared(p: torch.nn.Parameter) -> torch.nn.Parameter:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(p, False, -1, 1)
    setattr(p, SHARED, True)
    return p


def _sharded(p: torch.nn.Parameter, dim: int) -> torch.nn.Parameter:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(p, True, dim, 1)
    return p


class PrefixEncoder(MegatronModule):
    """The projection's shared part (replicated on every TP rank and pipeline stage):
    forward() -> tanh(E W1^T + b1) [n, enc], E [n, td] (`embedding`), W1 [enc, td] (`weight`),
    b1 [enc] (`bias`); initialised like PEFT's Embedding (normal) and Linear (uniform) from
    (seed, "prefix_encoder"), so every layout starts from the same values."""

    def __init__(self, config, n: int, token_dim: int, hidden: int, seed: int, dtype):
        super().__init__(config=config)
        g = torch.Generator().manual_seed(adapter_seed(seed, ENCODER))
        bound = 1.0 / math.sqrt(token_dim)
        # Drawn on the host from the seeded generator (the same values on any device), then
        # held on the rank's device like every other parameter.
        here = dict(device=runtime.device(), dtype=dtype)
        self.embedding = _shared(torch.nn.Parameter(
            torch.randn(n, token_dim, generator=g, dtype=torch.float64, device="cpu").to(**here)))
        self.weight = _shared(torch.nn.Parameter(_uniform((hidden, token_dim), bound, g).to(**here)))
        self.bias = _shared(torch.nn.Parameter(_uniform((hidden,), bound, g).to(**here)))

    def forward(self) -> torch.Tensor:
        return torch.tanh(F.linear(self.embedding, self.weight, self.bias))

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Replicated over TP, PP and DP: one main replica (TP rank 0 of stage 0, DP rank 0)."""
        from megatron.core.utils import make_sharded_tensor_for_checkpoint

        replica = (parallel_state.get_pipeline_model_parallel_rank(),
                   parallel_state.get_tensor_model_parallel_rank(),
                   parallel_state.get_data_parallel_rank(with_context_parallel=True))
        return {f"{prefix}{name}": make_sharded_tensor_for_checkpoint(
                    p, f"{prefix}{name}", sharded_offsets, replica_id=replica)
                for name, p in self.named_parameters()}


class PrefixAttention(MegatronModule):
    """Around a layer's core attention (megatron's DotProductAttention or SDPAttention): the
    layer's prefix keys/values prepended to `key`/`value` and the mask extended to see them.

    forward(query [sq, b, np, hn], key/value [sk, b, ng, hn], attention_mask None or bool
    [b, 1, sq, sk], ...) -> the base's context [sq, b, np * hn]. Parameters (this TP rank's
    groups): `prefix_kv` [n, 2, ng, hn], or with projection `prefix_proj_weight`
    [2, ng, hn, enc] and `prefix_proj_bias` [2, ng, hn] (PEFT's last Linear, this layer's rows).
    """

    def __init__(self, base_layer, state: PrefixState, name: str, *, n: int, groups: int,
                 head_dim: int, seed: int, dtype, encoder: Optional[PrefixEncoder] = None):
        super().__init__(config=base_layer.config)
        self.base_layer = base_layer
        self.global_name = name
        self._state = [state]
        self._encoder = [encoder] if encoder is not None else []  # shared, not a submodule
        t, k = _tp()
        local = groups // t
        part = slice(k * local, (k + 1) * local)
        g = torch.Generator().manual_seed(adapter_seed(seed, name))
        if encoder is None:  # PEFT's Embedding rows: normal(0, 1)
            full = torch.randn(n, 2, groups, head_dim, generator=g, dtype=torch.float64, device="cpu")
            self.prefix_kv = _sharded(torch.nn.Parameter(
                full[:, :, part].to(device=runtime.device(), dtype=dtype)), 2)
        else:  # PEFT's Linear(enc, L * 2 * td) init, this layer's rows
            hidden = encoder.weight.shape[0]
            bound = 1.0 / math.sqrt(hidden)
            w = _uniform((2, groups, head_dim, hidden), bound, g)[:, part]
            b = _uniform((2, groups, head_dim), bound, g)[:, part]
            here = dict(device=runtime.device(), dtype=dtype)
            self.prefix_proj_weight = _sharded(torch.nn.Parameter(w.to(**here)), 1)
            self.prefix_proj_bias = _sharded(torch.nn.Parameter(b.to(**here)), 1)

    def prefix(self) -> torch.Tensor:
        """This rank's [n, 2, ng, hn] prefix keys (index 0) and values (index 1)."""
        if not self._encoder:
            return self.prefix_kv
        u = self._encoder[0]()  # [n, enc]
        return torch.einsum("ne,kghe->nkgh", u, self.prefix_proj_weight) + self.prefix_proj_bias

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, **kwargs):
        if packed_seq_params is not None:
            raise ValueError("prefix tuning takes packed samples as a block-diagonal "
                             "attention_mask, not packed_seq_params")
        state = self._state[0]
        sq, b = query.shape[0], query.shape[1]
        sk = key.shape[0]
        kv = self.prefix().to(key.dtype)  # [n, 2, ng, hn]
        n = kv.shape[0]
        key = torch.cat([kv[:, 0].unsqueeze(1).expand(n, b, -1, -1), key], dim=0)
        value = torch.cat([kv[:, 1].unsqueeze(1).expand(n, b, -1, -1), value], dim=0)
        mask = state.mask(attention_mask, sq, sk, query.device)
        return self.base_layer(query, key, value, mask, attn_mask_type=attn_mask_type,
                               attention_bias=attention_bias, packed_seq_params=None, **kwargs)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The base's entries (none for these core attentions) and this layer's parameters,
        sharded by query groups over TP and stacked over layers by the block's offsets."""
        from megatron_lora.lora.checkpoint import factor_sharded_tensors, with_dp_cp_group

        metadata = with_dp_cp_group(metadata)
        state = self.base_layer.sharded_state_dict(prefix=f"{prefix}base_layer.",
                                                   sharded_offsets=sharded_offsets,
                                                   metadata=metadata)
        own = {name: p for name, p in self.named_parameters(recurse=False)}
        axis = {name: p.partition_dim for name, p in own.items()}
        state.update(factor_sharded_tensors(own, prefix, axis, sharded_offsets, metadata,
                                            parallel_state.get_tensor_model_parallel_group()))
        return state

    def extra_repr(self) -> str:
        return f"{self.global_name}, projection={bool(self._encoder)}"


_CORE_ATTENTIONS: List[type] = []


def register_prefix_core_attention(cls: type) -> type:
    """Declare that core attention class `cls` takes the prefix's keys and values as megatron's
    DotProductAttention does (query [s, b, n, d], key/value [s', b, g, d], an attention mask
    over [s, s']); the class that holds them registers itself (models/attention.py)."""
    if cls not in _CORE_ATTENTIONS:
        _CORE_ATTENTIONS.append(cls)
    return cls


def prefix_core_attentions() -> tuple:
    """The core attention classes prefix tuning wraps: megatron's DotProductAttention and the
    registered ones."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return (DotProductAttention, *_CORE_ATTENTIONS)


def prefix_problems(model, config) -> List[str]:
    """Prefix-tuning problems of a GPT model that every rank finds alike, before any change."""
    tconf = model.config
    problems = []
    if tconf.context_parallel_size != 1:
        problems.append("prefix tuning needs context_parallel_size=1")
    if getattr(model, "position_embedding_type", "rope") != "rope":
        problems.append(f"prefix tuning needs RoPE positions, the model has "
                        f"{model.position_embedding_type!r}")
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    layers = getattr(getattr(model, "decoder", None), "layers", [])
    if any(isinstance(layer.self_attention, MultiLatentAttention) for layer in layers):
        problems.append("prefix tuning is not available for multi-latent attention (DeepSeek-V3 "
                        "/ V2) yet: train LoRA instead (--peft-type lora)")
        return problems
    for layer in layers:
        core = layer.self_attention.core_attention
        if not isinstance(core, prefix_core_attentions()):
            problems.append(f"prefix tuning needs megatron's DotProductAttention or SDPAttention "
                            f"as core attention (--attention-backend unfused or flash), the model "
                            f"has {type(core).__name__}")
            break
    return problems


def apply_prefix(model, config) -> Dict[str, torch.nn.Module]:
    """Prefix tuning on this stage's GPT model (in place; the caller froze the base): a
    PrefixAttention around every layer's core attention, the rotary embedding moved by n, a
    forward pre-hook that takes packed positions from the attention mask, and with projection
    the shared `prefix_encoder` on the model. Returns {global name: module}."""
    n = config.num_virtual_tokens
    tconf = model.config
    groups, head_dim = tconf.num_query_groups, tconf.kv_channels
    dtype = config.dtype or tconf.params_dtype
    state = PrefixState(n)
    wrapped: Dict[str, torch.nn.Module] = {}
    encoder = None
    if config.prefix_projection:
        hidden = config.encoder_hidden_size or groups * head_dim
        encoder = PrefixEncoder(tconf, n, groups * head_dim, hidden, config.seed, dtype)
        setattr(model, ENCODER, encoder)
        wrapped[ENCODER] = encoder
    for layer in model.decoder.layers:
        name = f"{global_layer_prefix(layer)}.self_attention.prefix"
        attn = layer.self_attention
        attn.core_attention = PrefixAttention(
            attn.core_attention, state, name, n=n, groups=groups, head_dim=head_dim,
            seed=config.seed, dtype=dtype, encoder=encoder)
        wrapped[name] = attn.core_attention
    model.rotary_pos_emb = PrefixRotary(model.rotary_pos_emb, state)
    if getattr(tconf, "recompute_granularity", None) is not None:
        # megatron's checkpoint is re-entrant: the prefix inside a recomputed core attention
        # gets a gradient only if the region's inputs require grad, which with a frozen base
        # they do not unless the decoder input does (lora/input_grad.py).
        from megatron_lora.lora.input_grad import require_decoder_input_grad

        require_decoder_input_grad(model)

    def begin(module, args, kwargs):
        mask = kwargs.get("attention_mask", args[2] if len(args) > 2 else None)
        state.begin(mask)

    model.register_forward_pre_hook(begin, with_kwargs=True)
    return wrapped


def reduce_shared_prefix_grads(model_chunks) -> None:
    """Sum the gradients of the projection's replicated parameters (E, W1, b1) over the
    model-parallel group (TP x PP): each rank's holds its own layers' and query groups' part.
    Call on every rank after the backward passes of a step and before the DP reduction (training
    .step's finalize function does); with megatron's DDP the gradient is `main_grad`."""
    import torch.distributed as dist

    group = parallel_state.get_model_parallel_group()
    if group.size() == 1:
        return
    for chunk in model_chunks:
        for p in chunk.parameters():
            if not getattr(p, SHARED, False) or not p.requires_grad:
                continue
            grad = getattr(p, "main_grad", None)
            if grad is None:
                grad = p.grad
            if grad is None:  # every rank of the group holds E, W1, b1: never on one alone
                grad = p.grad = torch.zeros_like(p)
            dist.all_reduce(grad, group=group)


__all__ = ["PrefixAttention", "PrefixEncoder", "PrefixRotary", "PrefixState", "apply_prefix",
           "positions_from_mask", "prefix_problems", "reduce_shared_prefix_grads"]
