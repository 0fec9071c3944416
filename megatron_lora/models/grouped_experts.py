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

LoRA: the experts' stacked adapters (`experts.adapters`, lora/expert_lora.py, made by
lora/experts.wrap_experts) add their terms with one grouped matmul per factor over all local
experts, on the same row splits (offsets built once per call on the device); DoRA adapters add
each expert's DoRA output on its rows (a loop). Reductions are the expert adapters': the
replicated factor's gradient summed over expert-TP inside autograd, gradients reduced over the
expert-data-parallel group by megatron DDP. Dropout masks are the SequentialMLP path's: keys
sub_key(layer key, 2 e + j), rows' global token indices from the layer's token route
(lora/token_route.py), so grouped and sequential experts drop the same entries.

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

from megatron_lora.lora.dropout import expert_keys
from megatron_lora.lora.experts import ExpertSlot
from megatron_lora.lora.grouped import Splits, grouped_mm, grouped_mm_wgrad
from megatron_lora.models.nf4_linear import grouped_nf4, is_nf4, nf4_matmul


def _base_linear(linear: torch.nn.Module) -> torch.nn.Module:
    return linear.base_layer if isinstance(linear, ExpertSlot) else linear


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
        # The layer's one host read of its token counts (megatron's dispatchers may already hold
        # them on the host); every grouped matmul below reuses them and their device offsets.
        if torch.is_tensor(tokens_per_expert):
            splits = Splits(tokens_per_expert.tolist(), x.device, tokens_per_expert)
        else:
            splits = Splits(tokens_per_expert, x.device)
        counts = splits.counts
        if len(counts) != self.num_local_experts or sum(counts) != x.shape[0]:
            raise ValueError(
                f"GroupedExperts: tokens_per_expert {counts} does not fit "
                f"{self.num_local_experts} local experts and {x.shape[0]} rows"
            )
        chunks = expert_chunks(counts, x, self._rows_per_chunk(x))
        if len(chunks) == 1:
            return self._rows(x, probs, splits, 0, 0), None
        # CPU: fc1 -> activation -> fc2 a cache-sized run of experts at a time, so that each
        # run's [rows, 2f] intermediate is read back from cache, not memory (forward and, its
        # autograd nodes being per run, backward alike).
        # torch.split, not slicing: a slice's backward writes its gradient into a zero tensor of
        # the whole input, once per run; split's backward concatenates the runs' gradients once.
        sizes = [r1 - r0 for _, _, r0, r1 in chunks]
        outs = [self._rows(xs, ps, splits.part(e0, e1), e0, r0)
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

    def _rows(self, x, probs, splits: Splits, e0: int, r0: int) -> torch.Tensor:
        """fc1 -> activation -> fc2 for local experts e0 .. e0 + len(splits) - 1, whose rows
        x [n, h] start at row r0 of the layer's input: [n, h]."""
        counts = splits.counts
        h = self._linear("linear_fc1", x, splits, e0, r0)
        bias = self._row_bias("linear_fc1", counts, e0)
        if bias is not None:
            h = (h + bias).to(h.dtype)
        z = self._activation(h, probs)
        out = self._linear("linear_fc2", z, splits, e0, r0)
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

    def _linear(self, name: str, x: torch.Tensor, splits: Splits, e0: int = 0, r0: int = 0):
        """x [n, in_local] (rows of local experts e0.., from row r0 of the layer's input) times
        each expert's `name` weight, plus its adapter's term: [n, out_local]."""
        counts = splits.counts
        bases = [_base_linear(getattr(mlp, name)) for mlp in self._experts(e0, len(counts))]
        if all(is_nf4(base) for base in bases):
            out = grouped_nf4(x, counts, bases)
        else:
            out = _GroupedBase.apply(x, splits, *[base.weight for base in bases])
        adapters = self._modules.get("adapters")
        lora = adapters[name] if adapters is not None and name in adapters else None
        if lora is None or not lora.active():
            return out
        ids = key = None
        if lora.dropout() > 0.0:
            route = getattr(self, "token_route", None)
            if route is None or route.key is None or route.ids is None:
                raise RuntimeError(
                    "grouped experts: LoRA dropout needs the layer's token route; wrap the "
                    "experts with wrap_experts(..., moe_layer=layer)"
                )
            ids, key = route.ids[r0:r0 + x.shape[0]], route.key
        if lora.magnitude is not None:
            return self._dora_linear(lora, bases, x, out, counts, e0, ids, key)
        return out + lora.grouped(x, splits, e0, ids, key)

    @staticmethod
    def _dora_linear(lora, bases, x, out, counts, e0, ids, key):
        """DoRA adapters (lora/dora.py): each expert's rows get its DoRA output, the base term
        W_e d recomputed on its dropped rows only with dropout in training."""
        p = lora.dropout()
        keys = (expert_keys(key, lora.first_expert + e0, len(counts),
                            0 if lora.kind == "linear_fc1" else 1) if p > 0.0 else None)
        scales = lora.call_dora_scales()
        pieces, start = list(torch.split(out, counts)), 0
        for i, (base, n) in enumerate(zip(bases, counts)):
            if n:
                e = e0 + i
                drop = (p, keys[i], ids[start:start + n]) if p > 0.0 else None
                pieces[i] = lora.expert_dora(e, x[start:start + n], pieces[i], scales[e],
                                             lambda d, b=base: _base_rows(b, d), None, drop)
            start += n
        return torch.cat(pieces) if pieces else out


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


__all__ = ["GroupedExperts", "shared_stack", "stacked", "tie_weights"]
