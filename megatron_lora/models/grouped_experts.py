"""GroupedExperts: megatron's SequentialMLP with every local expert computed at once.

    spec = local_layer_spec(num_experts, moe_grouped_gemm=True)   # experts -> GroupedExperts

A subclass of megatron-core's `SequentialMLP` with the same submodules (`local_experts.{i}` MLPs
with `linear_fc1` / `linear_fc2`), the same parameters and the same `sharded_state_dict`, so a
base or adapter checkpoint written with one loads into the other, and everything that walks the
experts (LoRA wrapping, merge/unmerge, accounting, export) works unchanged. Only `forward`
differs: instead of a Python loop of 2 E small GEMMs (plus 4 E LoRA GEMMs), it runs

    h   = x W1_e^T (+ s * drop(x_e) A1_e^T B1_e^T)   one grouped matmul per weight / LoRA factor
    z   = act(h) * probs                             SwiGLU (or the config's activation), once
    out = z W2_e^T (+ s * drop(z_e) A2_e^T B2_e^T)   over the tokens_per_expert split

x [N, h] are the dispatcher's permuted rows (tokens_per_expert[e] rows for local expert e), h
[N, g*f/t] (g = 2 for gated units, t = expert-TP size), out [N, h] a partial sum over expert-TP
that the dispatcher reduces, exactly as SequentialMLP returns it. Grouped matmuls are
`torch._grouped_mm` where it takes the operands, an exact loop otherwise (lora/grouped.py).

On CPU the local experts run in consecutive runs of whole experts (`expert_chunks`), each run's
rows taking about CPU_CHUNK_BYTES in fc1 output, activation and fc2 output: fc1 -> activation ->
fc2 per run, so a run's intermediate is read back from cache rather than memory, in forward and
(its autograd nodes being per run) in backward. One expert with more rows than that is a run of
its own. On CUDA all experts are one run (one grouped matmul per weight).

Weights: at construction (and after every `.to()` / `.cuda()`) the E local fc1 weights are
re-homed into one [E, g*f/t, h] buffer (fc2: [E, h, f/t]), each expert's Parameter a view of its
slice: the grouped matmul reads the buffer with no copy, and autograd still delivers each
expert's gradient to its own Parameter. If something later gives a Parameter storage of its own
(megatron's distributed-optimizer buffers for trainable experts), forward stacks the weights
instead (a copy per call, never kept for backward): slower, still exact. NF4 bases
(--base-quantization nf4) keep their packed buffers: each call dequantises one linear kind of
the E local experts into one transient [E, out, in] stack for the grouped matmul, and again in
backward (models/nf4_linear.py).

LoRA: where a local expert's linear is a `LoraAdapter`, its factors join the grouped path
(factors stacked per call, [E, r, in] and [E, out, r]: small) when all local experts' adapters
of that linear agree on rank, scale and dropout and none is merged or disabled; otherwise each
adapter adds its own term on its rows (a loop, exact). Reductions are the per-expert adapters':
the replicated factor's gradient summed over expert-TP inside autograd, gradients reduced over
the expert-data-parallel group by megatron DDP. Dropout masks are the per-expert path's
(lora/grouped.py): keys sub_key(layer key, 2 e + j), rows' global token indices from the layer's
token route (lora/token_route.py), so grouped and sequential experts drop the same entries.

Biases (add_bias_linear, GPT-OSS): each row gets its expert's fc1 bias before the activation and
its expert's fc2 bias scaled by the row's probability after fc2, as megatron's MLP does for
experts; exact at any EP. With expert-TP > 1 megatron would add the fc2 bias on every expert-TP
rank's partial sum (megatron-core itself asserts ETP 1 for biased experts): refused, naming
--expert-tensor-parallel-size. The clamped SwiGLU (activation_func_clamp_value,
glu_linear_offset) is megatron MLP's unfused glu.

Not supported (refused at construction, naming the config field): expert biases under expert-TP
> 1 (above), Transformer Engine activation modules (use_te_activation_func), fp8 / fp4
expert inputs, delayed weight-gradient computation (delay_wgrad_compute). The activation is
computed unfused (megatron's bias_activation_fusion kernels are not called); in fp32 it equals
SequentialMLP's to rounding.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_lora.lora import collectives as C
from megatron_lora.lora.adapter import LoraAdapter
from megatron_lora.lora.dropout import expert_keys
from megatron_lora.lora.grouped import grouped_linear, grouped_mm, grouped_mm_wgrad
from megatron_lora.models.nf4_linear import grouped_nf4, is_nf4, nf4_matmul


def _base_linear(linear: torch.nn.Module) -> torch.nn.Module:
    return linear.base_layer if isinstance(linear, LoraAdapter) else linear


def tie_weights(params: Sequence[torch.nn.Parameter]) -> None:
    """Give equal-shaped Parameters one contiguous [E, ...] storage, each a view of its slice
    (values, identities and attributes unchanged)."""
    first = params[0]
    buffer = torch.empty((len(params),) + tuple(first.shape), dtype=first.dtype,
                         device=first.device)
    with torch.no_grad():
        for e, p in enumerate(params):
            buffer[e].copy_(p)
    for e, p in enumerate(params):
        p.data = buffer[e]


def shared_stack(params: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """[E, ...] view over the Parameters' common storage if they are its consecutive slices
    (tie_weights), else None."""
    first = params[0]
    if not first.is_contiguous():
        return None
    storage, numel = first.untyped_storage().data_ptr(), first.numel()
    for e, p in enumerate(params):
        if (p.untyped_storage().data_ptr() != storage or not p.is_contiguous()
                or p.shape != first.shape or p.dtype != first.dtype
                or p.storage_offset() != first.storage_offset() + e * numel):
            return None
    return first.detach().as_strided((len(params),) + tuple(first.shape),
                                     (numel,) + tuple(first.stride()), first.storage_offset())


def stacked(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """[E, ...] of the (detached) Parameters: the shared view, else a copy."""
    view = shared_stack(params)
    return view if view is not None else torch.stack([p.detach() for p in params])


class _GroupedBase(torch.autograd.Function):
    """forward: x [N, K] split by counts -> [N, M], rows of group e times W_e^T (weights: E
    Parameters [M, K]); backward: grads of x and of each W_e. Keeps x and the Parameters (no
    stacked copy): the stack is re-read (or rebuilt) in backward."""

    @staticmethod
    def forward(ctx, x, counts, *weights):
        ctx.counts = counts
        ctx.save_for_backward(x, *weights)
        w = stacked(weights)
        return grouped_mm(x, w.to(x.dtype).transpose(1, 2), counts)

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        g = grad.contiguous().to(x.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_mm(g, stacked(weights).to(x.dtype), ctx.counts)
        grads_w = [None] * len(weights)
        if any(ctx.needs_input_grad[2:]):
            grad_w = grouped_mm_wgrad(g, x, ctx.counts, len(weights))  # [E, M, K]
            grads_w = [grad_w[e].to(w.dtype) if ctx.needs_input_grad[2 + e] else None
                       for e, w in enumerate(weights)]
        return (grad_x, None, *grads_w)


class GroupedExperts(SequentialMLP):
    """SequentialMLP's module tree and checkpoints, one grouped computation for all local
    experts (see the module docstring). Constructed by megatron's MoELayer from the spec, with
    SequentialMLP's arguments."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, **kwargs):
        etp = getattr(config, "expert_tensor_parallel_size", 1) or 1
        problems = [
            f"TransformerConfig.{field}={getattr(config, field)!r} ({why})"
            for field, bad, why in (
                ("add_bias_linear", getattr(config, "add_bias_linear", False) and etp > 1,
                 f"expert biases with expert_tensor_parallel_size={etp}: every expert-TP rank "
                 "would add the fc2 bias to its partial sum; use --expert-tensor-parallel-size 1"),
                ("use_te_activation_func", getattr(config, "use_te_activation_func", False),
                 "Transformer Engine activation"),
                ("fp8", getattr(config, "fp8", None), "fp8 expert inputs"),
                ("fp4", getattr(config, "fp4", None), "fp4 expert inputs"),
                ("delay_wgrad_compute", getattr(config, "delay_wgrad_compute", False),
                 "delayed weight gradients"),
            ) if bad
        ]
        if problems:
            raise ValueError(
                "grouped experts (--moe-grouped-gemm) do not support "
                + "; ".join(problems) + "; use SequentialMLP experts (without --moe-grouped-gemm)"
            )
        super().__init__(num_local_experts, config, submodules, pg_collection, **kwargs)
        self._tie()

    def _tie(self) -> None:
        for name in ("linear_fc1", "linear_fc2"):
            bases = [_base_linear(getattr(mlp, name)) for mlp in self.local_experts]
            if any(is_nf4(base) for base in bases):
                continue  # NF4 bases hold packed buffers, not Parameters (models/nf4_linear.py)
            weights = [base.weight for base in bases]
            if shared_stack(weights) is None:
                tie_weights(weights)

    def _apply(self, fn, *args, **kwargs):
        # .to() / .cuda() / .half() give every Parameter new storage; re-home them.
        result = super()._apply(fn, *args, **kwargs)
        self._tie()
        return result

    # ---------------------------------------------------------------------------------------
    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert,
                permuted_probs: torch.Tensor):
        """[N, h] rows (expert by expert), tokens_per_expert [E] -> ([N, h] partial over
        expert-TP, None), as SequentialMLP.forward."""
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            # SequentialMLP's order: scale the input, then run the experts with probs 1.
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        counts = [int(c) for c in (tokens_per_expert.tolist()
                                   if torch.is_tensor(tokens_per_expert) else tokens_per_expert)]
        if len(counts) != self.num_local_experts or sum(counts) != x.shape[0]:
            raise ValueError(
                f"GroupedExperts: tokens_per_expert {counts} does not fit "
                f"{self.num_local_experts} local experts and {x.shape[0]} rows"
            )
        chunks = expert_chunks(counts, x, self._rows_per_chunk(x))
        if len(chunks) == 1:
            return self._rows(x, probs, counts, 0, 0), None
        # CPU: fc1 -> activation -> fc2 a cache-sized run of experts at a time, so that each
        # run's [rows, 2f] intermediate is read back from cache, not memory (forward and, its
        # autograd nodes being per run, backward alike).
        # torch.split, not slicing: a slice's backward writes its gradient into a zero tensor of
        # the whole input, once per run; split's backward concatenates the runs' gradients once.
        sizes = [r1 - r0 for _, _, r0, r1 in chunks]
        outs = [self._rows(xs, ps, counts[e0:e1], e0, r0)
                for (e0, e1, r0, _), xs, ps in zip(chunks, torch.split(x, sizes),
                                                  torch.split(probs, sizes))]
        return torch.cat(outs), None

    def _rows_per_chunk(self, x: torch.Tensor) -> Optional[int]:
        """Rows per run of experts on CPU (None: all at once, as on CUDA): a row's fc1 output,
        activation and fc2 output take (g + 1) * f/t + h values."""
        if x.is_cuda or not CPU_CHUNK_BYTES:
            return None
        cfg = self.config
        ffn = cfg.moe_ffn_hidden_size // (getattr(cfg, "expert_tensor_parallel_size", 1) or 1)
        width = (2 if cfg.gated_linear_unit else 1) * ffn + ffn + cfg.hidden_size
        return max(1, CPU_CHUNK_BYTES // (width * x.element_size()))

    def _rows(self, x, probs, counts: List[int], e0: int, r0: int) -> torch.Tensor:
        """fc1 -> activation -> fc2 for local experts e0 .. e0 + len(counts) - 1, whose rows
        x [n, h] start at row r0 of the layer's input: [n, h]."""
        h = self._linear("linear_fc1", x, counts, 0, e0, r0)
        bias = self._row_bias("linear_fc1", counts, e0)
        if bias is not None:
            h = (h + bias).to(h.dtype)
        z = self._activation(h, probs)
        out = self._linear("linear_fc2", z, counts, 1, e0, r0)
        bias = self._row_bias("linear_fc2", counts, e0)
        if bias is not None:  # MLP.forward for experts: the fc2 bias is scaled by the prob too
            out = (out + bias * probs.unsqueeze(-1)).to(out.dtype)
        return out

    def _experts(self, e0: int, num: int):
        return list(self.local_experts)[e0:e0 + num]

    def _row_bias(self, name: str, counts: List[int], e0: int = 0) -> Optional[torch.Tensor]:
        """[n, out] each row's expert bias of `name` (None without biases): the local biases of
        experts e0.. stacked (small) and repeated over each expert's rows; autograd delivers
        each expert's bias gradient to its own Parameter."""
        biases = [_base_linear(getattr(mlp, name)).bias for mlp in self._experts(e0, len(counts))]
        if biases[0] is None:
            return None
        repeats = torch.tensor(counts, device=biases[0].device)
        return torch.repeat_interleave(torch.stack(biases), repeats, dim=0,
                                       output_size=sum(counts))

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """megatron MLP's unfused activation with per-row probabilities (MLP.forward)."""
        cfg = self.config
        if cfg.gated_linear_unit:
            gate, linear = torch.chunk(h, 2, dim=-1)
            clamp = getattr(cfg, "activation_func_clamp_value", None)
            if clamp is not None:
                gate = gate.clamp(min=None, max=clamp)
                linear = linear.clamp(min=-clamp, max=clamp)
            act = cfg.activation_func(gate) * (linear + getattr(cfg, "glu_linear_offset", 0.0))
        else:
            act = cfg.activation_func(h)
        return (act * probs.unsqueeze(-1)).to(act.dtype)

    def _linear(self, name: str, x: torch.Tensor, counts: List[int], stream: int, e0: int = 0,
                r0: int = 0):
        linears = [getattr(mlp, name) for mlp in self._experts(e0, len(counts))]
        bases = [_base_linear(lin) for lin in linears]
        if all(is_nf4(base) for base in bases):
            out = grouped_nf4(x, counts, bases)
        else:
            out = _GroupedBase.apply(x, counts, *[base.weight for base in bases])
        adapters = [lin for lin in linears
                    if isinstance(lin, LoraAdapter) and not (lin.merged or lin._disabled)]
        if not adapters:
            return out
        if any(ad.magnitude is not None for ad in adapters):
            return self._dora_linear(linears, adapters, bases, x, out, counts)
        if len(adapters) == len(linears) and _uniform(adapters):
            return out + self._grouped_lora(adapters, x, counts, stream, e0, r0)
        # Mixed adapters (rank patterns, some merged): each adds its own term on its rows.
        pieces, start = list(torch.split(out, counts)), 0
        for e, (lin, n) in enumerate(zip(linears, counts)):
            if lin in adapters and n:
                pieces[e] = pieces[e] + lin.lora_delta(x[start:start + n])
            start += n
        return torch.cat(pieces) if pieces else out

    @staticmethod
    def _dora_linear(linears, adapters, bases, x, out, counts):
        """DoRA adapters (lora/dora.py): each expert's rows get its adapter's DoRA output, the
        base term W_e d recomputed on its dropped rows only with dropout in training."""
        pieces, start = list(torch.split(out, counts)), 0
        for e, (lin, n) in enumerate(zip(linears, counts)):
            if lin in adapters and n:
                base = bases[e]
                pieces[e] = lin.dora_forward(
                    x[start:start + n], pieces[e],
                    base_fn=lambda d, b=base: _base_rows(b, d))
            start += n
        return torch.cat(pieces) if pieces else out

    def _grouped_lora(self, adapters: List[LoraAdapter], x, counts, stream: int, e0: int = 0,
                      r0: int = 0):
        """sum over local experts e0.. of s * drop(x_e) A_e^T B_e^T on their rows (x: the
        layer's rows from r0 on): [n, out_local]."""
        first = adapters[0]
        g = first.geometry
        a = torch.stack([ad.lora_A for ad in adapters])  # [E, r, in_local]
        b = torch.stack([ad.lora_B for ad in adapters])  # [E, out_local, r]
        if stream == 0:  # column: A replicated over expert-TP, its gradient partial there
            a, offset = C.grad_sum(a, g.tp_group), 0
        else:  # row: B replicated, A holds this rank's input columns
            b, offset = C.grad_sum(b, g.tp_group), g.tp_rank * g.in_local
        p = first.config.dropout if first.training else 0.0
        keys = ids = None
        if p > 0.0:
            route = getattr(self, "token_route", None)
            if route is None or route.key is None or route.ids is None:
                raise RuntimeError(
                    "grouped experts: LoRA dropout needs the layer's token route; wrap the "
                    "experts with wrap_experts(..., moe_layer=layer)"
                )
            ids = route.ids[r0:r0 + x.shape[0]]
            keys = expert_keys(route.key, route.first_expert + e0, len(adapters), stream)
        u = grouped_linear(x, a, counts, first.scaling, p, keys, offset, ids)  # [N, r]
        return grouped_linear(u, b, counts)


# On CPU the experts run in consecutive runs of whole experts whose fc1 and fc2 outputs together
# take about this many bytes (one expert per run where one alone is larger); 0: all at once.
CPU_CHUNK_BYTES = 8 << 20


def expert_chunks(counts: List[int], x: torch.Tensor, rows_per_chunk: Optional[int]) -> list:
    """[(e0, e1, r0, r1)]: runs of consecutive experts e0..e1-1 holding rows r0..r1-1, each of
    at most rows_per_chunk rows unless one expert alone has more (None: one run of all)."""
    if rows_per_chunk is None:
        return [(0, len(counts), 0, x.shape[0])]
    chunks, e0, r0, rows = [], 0, 0, 0
    for e, n in enumerate(counts):
        if rows and rows + n > rows_per_chunk:
            chunks.append((e0, e, r0, r0 + rows))
            e0, r0, rows = e, r0 + rows, 0
        rows += n
    chunks.append((e0, len(counts), r0, r0 + rows))
    return chunks


def _base_rows(base: torch.nn.Module, d: torch.Tensor) -> torch.Tensor:
    """d W^T for one expert's base linear (NF4: dequantised inside the GEMM's Function)."""
    if is_nf4(base):
        return nf4_matmul(d, base)
    return torch.nn.functional.linear(d, base.weight.to(d.dtype))


def _uniform(adapters: List[LoraAdapter]) -> bool:
    first = adapters[0]
    return all(ad.config.rank == first.config.rank and ad.scaling == first.scaling
               and ad.config.dropout == first.config.dropout
               and ad.lora_A.dtype == first.lora_A.dtype for ad in adapters)


__all__ = ["GroupedExperts", "shared_stack", "stacked", "tie_weights"]
