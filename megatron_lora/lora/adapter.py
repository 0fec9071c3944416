"""LoraAdapter: LoRA on a megatron tensor-parallel linear, exact under TP and SP.

    out, bias = LoraAdapter(base, AdapterConfig(rank=16, alpha=32))(x)

returns what `base(x)` returns, in the same parallel state, plus scale * dropout(x) A^T B^T.

Factor layout (t = size of the base's group, r = rank):
    column base (W [out/t, in]):  A [r, in] replicated,   B [out/t, r] sharded on dim 0 like W
    row base    (W [out, in/t]):  A [r, in/t] sharded on dim 1 like W,   B [out, r] replicated

LoRA-path communication per forward+backward ([T, r] = tokens x rank; nothing hidden-sized):
    column, no SP:   forward nothing;            backward all-reduce [T, r]
    column, SP:      forward all-gather [T/t,r]; backward reduce-scatter [T, r]
    row, no SP:      forward all-reduce [T, r];  backward nothing
    row, SP:         forward reduce-scatter [T,r]; backward all-gather [T/t, r]
    column with gather_output: all-gather B ([out, r], a weight) instead of the output, so the
        backward all-reduce disappears (the output gradient is already complete on every rank)
    row with a non-parallel input: all-gather A ([r, in], a weight); no activation collective.
    expert linear with explicit expert communication (group = expert-TP, see parallel.py):
        no activation collective at all. The token dispatcher reduces the base's partial sums
        (column input gradient, row output) and the LoRA term's with them; the replicated factor
        (column A, row B) sees a partial gradient on each rank and is summed over the expert-TP
        group by `collectives.grad_sum` ([r, in] / [out, r], once per forward).

Gradients of a replicated factor that sees different tokens on each rank (column A under SP, row
B under SP) are partial sums; the factor carries megatron's `sequence_parallel = True` attribute,
so `finalize_model_grads` sums them over the TP group with the layer norms' gradients (once per
step, after gradient accumulation). Nothing here uses parameter hooks. Expert adapters carry
`allreduce = False` (megatron DDP reduces them over the expert-data-parallel group) and never
`sequence_parallel` (finalize_model_grads knows only the dense TP group).

A column base with partition stride > 1 (a gated fc1: rank k holds [gate_k; up_k]) gets its B
rows with the same stride, so B's global layout is the base weight's ([gate; up]) at every TP.

Factors are initialised as global tensors from a generator seeded with `seed`, then sliced, so
the global factors are the same at every layout.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from megatron_lora.lora import collectives as C
from megatron_lora.lora import dora as D
from megatron_lora.lora import merge as M
from megatron_lora.lora.checkpoint import (
    accept_unwrapped_keys,
    linear_factor_entries,
    with_dp_cp_group,
)
from megatron_lora.lora.config import AdapterConfig
from megatron_lora.lora.dropout import draw_dropout_key
from megatron_lora.lora.factors import init_global_factors, shard_like_base, up_projection
from megatron_lora.lora.parallel import (COLUMN, LinearGeometry, base_weight_meta,
                                          describe_base_layer)
from megatron_lora.lora.projection import lora_down


class LoraAdapter(torch.nn.Module):
    """A LoRA adapter around a megatron column- or row-parallel linear.

    base_layer: megatron-core ColumnParallelLinear / RowParallelLinear, or a linear with
        `parallel_mode` "column"/"row" (Transformer Engine style). Kept as `self.base_layer`.
    config: AdapterConfig (not modified).
    seed: seeds the global factor initialisation (same factors at every layout).
    freeze_base: set requires_grad=False on the base weight and bias (standard LoRA).

    forward(input_, *args, **kwargs) -> (output, bias), exactly as the base returns them:
        column: input [s/t, b, in] under SP, else [s, b, in] (replicated); output [s, b, out/t]
            (sharded on dim 2), or [s, b, out] (replicated) with gather_output.
        row: input [s, b, in/t] (sharded on dim 2), or [s, b, in] replicated if not
            input_is_parallel; output [s/t, b, out] under SP, else [s, b, out] (replicated).
        bias: the base's bias when skip_bias_add, else None (bias already added).
    """

    # Set by apply_lora from the adapter's global name (lora/identity.py): the dropout masks'
    # key stream inside a training step; None (a module used alone) draws keys instead.
    dropout_stream: Optional[int] = None

    def __init__(
        self,
        base_layer: torch.nn.Module,
        config: AdapterConfig,
        *,
        seed: int = 0,
        freeze_base: bool = True,
    ):
        super().__init__()
        if not isinstance(config, AdapterConfig):
            raise TypeError(f"config must be an AdapterConfig, got {type(config).__name__}")
        # All validation is local and comes before anything that could communicate.
        geometry = describe_base_layer(base_layer)
        if config.use_dora:
            D.check_dora_base(geometry)
        limit = min(geometry.in_features, geometry.out_features)
        if config.rank > limit:
            raise ValueError(
                f"AdapterConfig.rank={config.rank} is larger than min(in_features, out_features)"
                f" = min({geometry.in_features}, {geometry.out_features}) = {limit} of base_layer"
            )
        self.base_layer = base_layer
        self.config = config
        self.geometry: LinearGeometry = geometry
        self.scaling = config.scaling
        self.merged = False
        self._disabled = False
        # Expert adapters (token_route.py): input -> (key, int64 [rows] global token indices)
        # for dropout, since expert rows are the dispatcher's permuted tokens. None: dense.
        self.dropout_rows = None

        weight = base_weight_meta(base_layer)
        if weight is None:  # output layer with tied embeddings: the weight comes at forward
            dtype, device = config.dtype or base_layer.config.params_dtype, None
        else:
            dtype, device = config.dtype or weight.dtype, weight.device
        a, b = init_global_factors(config, geometry.in_features, geometry.out_features, seed)
        t, rank = geometry.tp_size, geometry.tp_rank
        if geometry.mode == COLUMN:
            b = shard_like_base(b, 0, t, rank, geometry.stride)
        else:
            a = shard_like_base(a, 1, t, rank)
        self.lora_A = torch.nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.lora_B = torch.nn.Parameter(b.to(device=device, dtype=dtype).contiguous())
        if config.use_dora:
            # DoRA magnitude m [out_local], initialised as PEFT does to ||W + scale B A||_row
            # (row bases: one [out] all-reduce over the base's group, see dora.py).
            m = D.weight_norm(self)
            setattr(self, D.MAGNITUDE, torch.nn.Parameter(m.to(dtype=dtype).contiguous()))
        self._set_parallel_attributes(weight)
        _adopt_forward_hooks(self, base_layer)
        if freeze_base:
            for p in base_layer.parameters(recurse=False):
                p.requires_grad_(False)
        accept_unwrapped_keys(self)

    # megatron code reads these on the module it built (LanguageModule: `output_layer.weight`,
    # `embedding.word_embeddings.weight`); the wrapper answers for its base.
    @property
    def weight(self):
        return self.base_layer.weight

    @property
    def bias(self):
        return getattr(self.base_layer, "bias", None)

    def _set_parallel_attributes(self, base_weight: Optional[torch.Tensor]) -> None:
        g = self.geometry
        if g.mode == COLUMN:
            sharded, replicated, dim = self.lora_B, self.lora_A, 0
        else:
            sharded, replicated, dim = self.lora_A, self.lora_B, 1
        # The attributes megatron's optimizer and grad-norm code read: a sharded factor counts
        # once per TP rank, a replicated one once per group.
        set_tensor_model_parallel_attributes(sharded, True, dim, 1)
        set_tensor_model_parallel_attributes(replicated, False, -1, 1)
        # Replicated factor fed different tokens on each rank (SP): its gradient is partial and
        # finalize_model_grads sums parameters marked like this over the TP group.
        # Expert linears never: their group is not the dense TP group finalize_model_grads uses.
        replicated.sequence_parallel = g.sequence_parallel and not g.is_expert
        sharded.sequence_parallel = False
        # Data-parallel reduction group: expert adapters always go to the expert-data-parallel
        # buffers (allreduce=False), even at EP=1 where megatron leaves its own expert weights
        # dense: with expert-TP != TP the expert-DP group is not the dense DP group.
        allreduce = not g.is_expert and getattr(base_weight, "allreduce", True)
        for p in (self.lora_A, self.lora_B):
            p.allreduce = allreduce
        m = self.magnitude
        if m is not None:
            # Column: sharded like the base's output rows (with its stride); row: replicated,
            # its gradient partial over tokens under SP (summed like the replicated factor's).
            column = g.mode == COLUMN
            set_tensor_model_parallel_attributes(m, column, 0 if column else -1,
                                                 g.stride if column else 1)
            m.sequence_parallel = (not column) and g.sequence_parallel and not g.is_expert
            m.allreduce = allreduce

    @property
    def magnitude(self) -> Optional[torch.Tensor]:
        """The DoRA magnitude vector (column: [out/t], row: [out]), or None without DoRA."""
        return self._parameters.get(D.MAGNITUDE)

    # ---------------------------------------------------------------------------------------
    # forward
    # ---------------------------------------------------------------------------------------
    def forward(self, input_: torch.Tensor, *args, **kwargs):
        output, bias = self.base_layer(input_, *args, **kwargs)
        if self.merged or self._disabled:
            return output, bias
        gather_output = self._gathers_output(args, kwargs)
        if self.magnitude is not None:
            base_fn = lambda d: self.base_layer(d, *args, **kwargs)[0]  # noqa: E731
            return self.dora_forward(input_, output, D.added_bias(self, bias), gather_output,
                                     base_fn), bias
        return self._lora(input_, gather_output, add_to=output), bias

    def dora_scale(self) -> torch.Tensor:
        """m / ||W + scale B A||_row ([out_local], the norm detached; see dora.py). Expert row
        bases (output a partial sum over expert-TP): m's gradient is summed over that group."""
        g = self.geometry
        m = self.magnitude
        if g.dispatcher_reduces and g.mode != COLUMN:
            m = C.grad_sum(m, g.tp_group)
        return m / D.step_weight_norm(self).to(m.dtype)

    def dora_forward(self, input_, output, added_bias=None, gather_output=False, base_fn=None):
        """PEFT's DoRA output: output + (m/n - 1) * W d + (m/n) * scale * B A d (dora.py).

        output: the base's output on input_ (in its parallel state), added_bias: the bias it
        added (None: none), base_fn(d): the base's output on another input d (called only with
        dropout > 0 in training, on the dropped input; default: the base layer itself)."""
        g = self.geometry
        drop = self._dropout_state(input_)
        scale = self.dora_scale()
        if gather_output:
            scale = C.gather_weight(scale, g.tp_group, 0)
            if added_bias is not None:  # the base added its bias shard before the gather
                added_bias = C.gather_weight(added_bias, g.tp_group, 0)
        p, key, rows = drop
        if p == 0.0:
            # W d = W x: out = (m/n) * (W x + scale B A x) + bias, the LoRA term accumulated
            # into W x by one addmm (the same value as PEFT's three-term sum, to rounding).
            base_result = output if added_bias is None else output - added_bias
            out = self._lora(input_, gather_output, add_to=base_result, drop=drop)
            out = out * scale.to(out.dtype)
            return out if added_bias is None else out + added_bias
        # Dropout: PEFT's output + (m/n - 1) * W d + (m/n) * scale * B A d, W d from the base.
        lora = self._lora(input_, gather_output, drop=drop)
        tokens_local = input_.numel() // input_.shape[-1]
        tok0 = g.tp_rank * tokens_local if g.sequence_parallel and g.mode == COLUMN else 0
        feat0 = g.tp_rank * g.in_local if g.mode != COLUMN and g.input_is_parallel else 0
        dropped = D.dropped_input(input_, p, key, tok0, feat0, rows)
        base_fn = base_fn or (lambda d: self.base_layer(d)[0])
        base_result = base_fn(dropped)
        if added_bias is not None:
            base_result = base_result - added_bias
        return D.combine(output, base_result, lora, scale)

    def _dropout_state(self, input_):
        """(p, key, rows): this forward's dropout probability, key and (experts) row indices."""
        p = self.config.dropout if self.training else 0.0
        key = rows = None
        if p > 0.0 and self.dropout_rows is not None:
            key, rows = self.dropout_rows(input_)  # expert: the layer's key, global row indices
        elif p > 0.0:
            key = draw_dropout_key(input_.device, self.dropout_stream)
        return p, key, rows

    def _gathers_output(self, args, kwargs) -> bool:
        # ColumnParallelLinear.forward(input_, weight=None, runtime_gather_output=None)
        if self.geometry.mode != COLUMN:
            return False
        runtime = kwargs.get("runtime_gather_output", args[1] if len(args) > 1 else None)
        return self.geometry.gather_output if runtime is None else bool(runtime)

    def lora_delta(self, input_: torch.Tensor, gather_output: Optional[bool] = None):
        """scale * dropout(input_) A^T B^T in the parallel state of the base's output."""
        return self._lora(input_, gather_output)

    def _lora(self, input_, gather_output=None, add_to=None, drop=None):
        g = self.geometry
        group = g.tp_group
        p, key, rows = self._dropout_state(input_) if drop is None else drop
        tokens_local = input_.numel() // input_.shape[-1]
        if g.dispatcher_reduces:
            return self._expert_lora(input_, p, key, add_to, rows)
        if g.mode == COLUMN:
            gather_output = g.gather_output if gather_output is None else gather_output
            # Input: this rank's sequence shard under SP (tokens start at rank * local tokens,
            # sequence being the outermost dim), else all tokens; all features.
            offset = g.tp_rank * tokens_local if g.sequence_parallel else 0
            u = lora_down(input_, self.lora_A, self.scaling, p, key, offset, 0, rows)
            if g.sequence_parallel:
                # [s/t, b, r] -> [s, b, r]. With a gathered output the output gradient is
                # complete on every rank, so backward keeps the own slice instead of summing.
                u = C.gather_tokens(u, group, grad_is_partial=not gather_output)
            elif not gather_output:
                # Each rank's B shard gives a partial gradient of u; summing it makes the
                # gradients of A and of the input complete.
                u = C.grad_all_reduce(u, group)
            b = C.gather_weight(self.lora_B, group, 0) if gather_output else self.lora_B
            return up_projection(u, b, add_to)
        if g.input_is_parallel:
            # Input [s, b, in/t]: the product with this rank's A columns is a partial sum.
            offset = g.tp_rank * g.in_local
            u = lora_down(input_, self.lora_A, self.scaling, p, key, 0, offset, rows)
            if g.sequence_parallel:
                u = C.reduce_scatter_tokens(u, group)  # -> [s/t, b, r], this rank's tokens
            else:
                u = C.all_reduce(u, group)  # -> [s, b, r], replicated
        else:
            # Input replicated [s, b, in]: gather A (a weight) rather than any activation.
            a = C.gather_weight(self.lora_A, group, 1)
            u = lora_down(input_, a, self.scaling, p, key, 0, 0, rows)
        return up_projection(u, self.lora_B, add_to)

    def _expert_lora(self, input_, p, key, add_to, rows):
        # Input [tokens, in] (column: the same tokens on every expert-TP rank; row: this rank's
        # [tokens, in/t] slice). No activation collective: the dispatcher sums what the base
        # leaves partial, and the LoRA term is partial in exactly the same way.
        g = self.geometry
        if g.mode == COLUMN:
            # dL/du = dL/dy_k B_k^T is partial over the group (B sharded on out): A's gradient is
            # summed over the group; the input gradient stays partial, like the base's.
            a = C.grad_sum(self.lora_A, g.tp_group)
            u = lora_down(input_, a, self.scaling, p, key, 0, 0, rows)
            return up_projection(u, self.lora_B, add_to)
        # u_k = x_k A_k^T is this rank's partial sum; u_k B^T summed by the dispatcher is exact,
        # but B's gradient dy^T u_k is partial: summed over the group.
        u = lora_down(input_, self.lora_A, self.scaling, p, key, 0, g.tp_rank * g.in_local, rows)
        return up_projection(u, C.grad_sum(self.lora_B, g.tp_group), add_to)

    # ---------------------------------------------------------------------------------------
    # merge / disable
    # ---------------------------------------------------------------------------------------
    def merge(self, safe: bool = False) -> None:
        """Add scale * B A into the base weight shard in place (idempotent; see merge.py)."""
        M.merge(self, safe=safe)

    def safe_merge(self) -> None:
        """merge() after checking on every rank that the result is finite; else ValueError and
        the base weight stays bit-identical."""
        M.merge(self, safe=True)

    def unmerge(self) -> None:
        """Subtract the update merged by merge() from the base weight shard."""
        M.unmerge(self)

    def delta_weight(self) -> torch.Tensor:
        """This rank's shard of scale * B A (fp32, the base weight's local shape)."""
        return M.delta_weight(self)

    @contextlib.contextmanager
    def disable_adapters(self):
        """Within the context forward returns the base layer's output alone."""
        if self.merged:
            raise RuntimeError(
                "LoraAdapter.disable_adapters: the adapter is merged into the base weight; "
                "unmerge() first"
            )
        previous = self._disabled
        self._disabled = True
        try:
            yield self
        finally:
            self._disabled = previous

    # ---------------------------------------------------------------------------------------
    # distributed checkpointing
    # ---------------------------------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """megatron dist_checkpointing entries: the base's own entries exactly as the unwrapped
        base produces them (same dict keys and ShardedTensor keys, so a checkpoint of the plain
        model loads into the wrapped one and megatron's parents find `linear_fc1.weight`,
        `output_layer.weight`), plus `lora_A` / `lora_B` sharded as they are held (column: B on
        dim 0, with the base's stride; row: A on dim 1), the other replicated over the base's
        group. Expert offsets passed in by SequentialMLP key them by global expert index."""
        metadata = with_dp_cp_group(metadata)
        state = self.base_layer.sharded_state_dict(
            prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata
        )
        factors = {"lora_A": self.lora_A, "lora_B": self.lora_B}
        if self.magnitude is not None:  # DoRA: m sharded like the base's output rows
            factors[D.MAGNITUDE] = self.magnitude
        state.update(linear_factor_entries(self.geometry, factors, D.MAGNITUDE, prefix,
                                           sharded_offsets, metadata))
        return state

    def extra_repr(self) -> str:
        return (
            f"{self.geometry.describe()}, rank={self.config.rank}, alpha={self.config.alpha}, "
            f"scaling={self.scaling:g}, dropout={self.config.dropout}, merged={self.merged}"
            + (", dora" if self.magnitude is not None else "")
        )


def _adopt_forward_hooks(adapter: torch.nn.Module, base_layer: torch.nn.Module) -> None:
    """Move the base's forward hooks onto the adapter, so that code which post-processes the
    layer's output sees the adapted output, as it did the base's: megatron_lora's MLA gathers
    linear_kv_down_proj's TP chunks in such a hook (models/mla.py); left on the base, it would
    gather the base's chunk only and the adapter's update could not be added to it."""
    for handle_id, hook in list(base_layer._forward_hooks.items()):
        adapter._forward_hooks[handle_id] = hook
        for flags in ("_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            if handle_id in getattr(base_layer, flags, {}):
                getattr(adapter, flags)[handle_id] = getattr(base_layer, flags).pop(handle_id)
    base_layer._forward_hooks.clear()
