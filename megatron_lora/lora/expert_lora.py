"""ExpertLora: the LoRA adapters of one linear (fc1 or fc2) of every local expert of an MoE layer,
as one module with stacked factors.

    lora = ExpertLora("linear_fc1", bases, configs, seeds, names=names, first_expert=ep_rank * E)
    delta = lora.grouped(x, splits)                    # [N, out_local]: all local experts at once
    y_e = lora.expert_term(e, x_e, add_to=base_out_e)  # one expert's rows (SequentialMLP's loop)

Factors, stacked over the E local experts (global expert g = first_expert + e; h hidden, f the
expert ffn size, s = 2 for gated units else 1, t = expert-TP size, k this rank's place in it):
    linear_fc1 (column): lora_A [E, r, h] replicated over expert-TP;
                         lora_B [E, s*f/t, r], each B_e's rows split like the weight's, with
                         partition stride s (rank k: [gate_k; up_k])
    linear_fc2 (row):    lora_A [E, r, f/t] sharded on dim 2 (rank k: columns k*f/t..);
                         lora_B [E, h, r] replicated over expert-TP
    DoRA:                lora_magnitude_vector [E, out_local] (fc1: sharded like B's rows;
                         fc2: replicated)
Expert g's pair is init_global_factors(config of its global name, in, out, seed of its global
name) sliced as its base weight: the same global pairs at every EP / expert-TP / PP layout and
dispatcher. Update of expert g: W_g += s_g B_g A_g with s_g its config's scaling (an
alpha_pattern may give experts different scales; ranks, dropout and dtype are one per layer: a
checkpoint stacks a kind's factors over layers and experts).

Computation. `grouped` runs one grouped matmul per factor and direction over the rows of all
local experts (lora/grouped.py: torch._grouped_mm on CUDA, the exact loop on CPU); the delta
weight is never formed. `expert_term` is one expert's term for SequentialMLP's per-expert loop:
the factors are split into per-expert views once per experts call (`open_call`), so backward
gathers each factor's gradient in one stack, not one select per expert. Reductions are those of
an expert linear (adapter.py): no activation collective; the replicated factor's partial
gradient is summed over expert-TP inside autograd (collectives.grad_sum, once per call);
parameters carry `allreduce = False` (megatron DDP reduces them over the expert-data-parallel
group). Dropout masks are layout-independent: row n of expert g is masked with
keep_mask_at(sub_key(layer key, 2 g + j), p, global token index of row n, features), j = 0 fc1 /
1 fc2 (token_route.py carries each row's global token index).

`expert(e)` gives a read-only view of one local expert's pair (its global name, factors as views
of the stacked tensors, base layer) for merging, export and checks.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import List, Optional, Sequence

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from megatron_lora.lora import collectives as C
from megatron_lora.lora import dora as D
from megatron_lora.lora import merge as M
from megatron_lora.lora.config import AdapterConfig
from megatron_lora.lora.dropout import expert_keys
from megatron_lora.lora.expert_view import ExpertView
from megatron_lora.lora.factors import init_global_factors, shard_like_base, up_projection
from megatron_lora.lora.grouped import Splits, as_splits, grouped_linear
from megatron_lora.lora.parallel import COLUMN, base_weight_meta, describe_base_layer
from megatron_lora.lora.projection import lora_down


class ExpertLora(torch.nn.Module):
    """The adapters of one linear kind of E local experts (layout in the module docstring).

    kind: "linear_fc1" (column) or "linear_fc2" (row).
    bases: the E local experts' base linears of that kind (kept as plain references: the
        experts' MLPs own them).
    configs / seeds / names: per local expert, from its global name (names[e] =
        f"{experts prefix}.{first_expert + e}.{kind}"). Ranks may differ (a rank pattern used
        with wrap_experts directly): the factors are zero-padded to the largest; scales may
        differ too. Dropout, dtype and DoRA are one per layer.
    first_expert: global index of local expert 0 (ep_rank * E).
    """

    def __init__(self, kind: str, bases: Sequence[torch.nn.Module],
                 configs: Sequence[AdapterConfig], seeds: Sequence[int], *,
                 names: Sequence[str], first_expert: int, freeze_base: bool = True):
        super().__init__()
        if kind not in ("linear_fc1", "linear_fc2"):
            raise ValueError(f"kind must be 'linear_fc1' or 'linear_fc2', got {kind!r}")
        if not (len(bases) == len(configs) == len(seeds) == len(names) >= 1):
            raise ValueError("ExpertLora needs one base, config, seed and name per local expert")
        first = configs[0]
        for what in ("dropout", "dtype", "use_dora"):
            values = {getattr(c, what) for c in configs}
            if len(values) > 1:
                raise ValueError(
                    f"{names[0].rsplit('.', 2)[0]}: the experts' {kind} adapters must share "
                    f"their {what} (one stacked tensor per layer), got {sorted(map(str, values))}")
        geometry = describe_base_layer(bases[0])
        if first.use_dora:
            D.check_dora_base(geometry)
        self.kind, self.geometry, self.config = kind, geometry, first
        self.configs, self.names = tuple(configs), tuple(names)
        self.first_expert = int(first_expert)
        self.scales = tuple(float(c.scaling) for c in configs)
        self.ranks = tuple(int(c.rank) for c in configs)
        self.rank = max(self.ranks)  # experts with a smaller rank are zero-padded to it
        self.__dict__["bases"] = tuple(bases)  # not submodules: the experts' MLPs own them
        self.merged = False
        self._disabled = False
        self._call: Optional[dict] = None  # the current experts call's per-expert views
        self._merge_norms: Optional[List[torch.Tensor]] = None

        weight = base_weight_meta(bases[0])
        dtype, device = first.dtype or weight.dtype, weight.device
        t, k = geometry.tp_size, geometry.tp_rank
        a_list, b_list = [], []
        for cfg, seed in zip(configs, seeds):
            a, b = init_global_factors(cfg, geometry.in_features, geometry.out_features, int(seed))
            if geometry.mode == COLUMN:
                b = shard_like_base(b, 0, t, k, geometry.stride)
            else:
                a = shard_like_base(a, 1, t, k)
            # A zero-padded rank adds exact zeros to every product and gets exactly zero
            # gradients, so the padding stays zero through training (Adam's step of a zero
            # gradient is zero, decoupled weight decay keeps zero at zero).
            pad = self.rank - cfg.rank
            a_list.append(torch.nn.functional.pad(a, (0, 0, 0, pad)))
            b_list.append(torch.nn.functional.pad(b, (0, pad)))
        self.lora_A = torch.nn.Parameter(torch.stack(a_list).to(device=device, dtype=dtype))
        self.lora_B = torch.nn.Parameter(torch.stack(b_list).to(device=device, dtype=dtype))
        # Per-row scales are needed only when an alpha pattern gives experts different scales.
        self.uniform_scale = len(set(self.scales)) == 1
        self.register_buffer("scale_vector", torch.tensor(self.scales, dtype=torch.float32,
                                                          device=device), persistent=False)
        if first.use_dora:
            # m_e initialised as PEFT does, to ||W_e + s_e B_e A_e||_row (fc2: the [out] squared
            # norms all-reduced over expert-TP, once per expert; dora.py).
            m = torch.stack([D.weight_norm(self.expert(e)) for e in range(len(bases))])
            setattr(self, D.MAGNITUDE, torch.nn.Parameter(m.to(dtype=dtype).contiguous()))
        self._set_parallel_attributes()
        if freeze_base:
            for base in bases:
                for p in base.parameters(recurse=False):
                    p.requires_grad_(False)

    def _set_parallel_attributes(self) -> None:
        g = self.geometry
        column = g.mode == COLUMN
        sharded, replicated = (self.lora_B, self.lora_A) if column else (self.lora_A, self.lora_B)
        # The stacked dim 0 is the expert axis; the local [r, in] / [out, r] dims follow.
        set_tensor_model_parallel_attributes(sharded, True, 1 if column else 2,
                                             g.stride if column else 1)
        set_tensor_model_parallel_attributes(replicated, False, -1, 1)
        params = [self.lora_A, self.lora_B]
        m = self.magnitude
        if m is not None:
            set_tensor_model_parallel_attributes(m, column, 1 if column else -1,
                                                 g.stride if column else 1)
            params.append(m)
        for p in params:
            p.allreduce = False  # expert-data-parallel buffers, at every EP size
            p.sequence_parallel = False  # no SP inside an expert; expert-TP sums in autograd

    @property
    def magnitude(self) -> Optional[torch.Tensor]:
        """DoRA magnitudes [E, out_local], or None without DoRA."""
        return self._parameters.get(D.MAGNITUDE)

    @property
    def bases(self) -> tuple:
        return self.__dict__["bases"]

    @property
    def num_experts(self) -> int:
        return self.lora_A.shape[0]

    def expert(self, local: int) -> ExpertView:
        return ExpertView(self, local)

    def experts(self) -> List[ExpertView]:
        return [ExpertView(self, e) for e in range(self.num_experts)]

    def active(self) -> bool:
        return not (self.merged or self._disabled)

    # ---------------------------------------------------------------------------------------
    # forward pieces
    # ---------------------------------------------------------------------------------------
    def factors(self):
        """(A, B) as forward uses them: the replicated one through grad_sum (fc1: A, fc2: B),
        so its partial gradient is summed over expert-TP; the feature offset of A's columns."""
        g = self.geometry
        if g.mode == COLUMN:
            return C.grad_sum(self.lora_A, g.tp_group), self.lora_B, 0
        return self.lora_A, C.grad_sum(self.lora_B, g.tp_group), g.tp_rank * g.in_local

    def dropout(self) -> float:
        return self.config.dropout if self.training else 0.0

    def grouped(self, x: torch.Tensor, splits, e0: int = 0, token_ids=None,
                key: Optional[torch.Tensor] = None) -> torch.Tensor:
        """sum over local experts e0 .. e0 + len(splits) - 1 of s_e drop(x_e) A_e^T B_e^T on
        their rows: x [n, in_local] -> [n, out_local] (fc2: partial over expert-TP). With
        dropout in training: token_ids int64 [n] (each row's global token index) and the MoE
        layer's key."""
        splits = as_splits(splits, x.device)
        num = len(splits)
        if e0 + num > self.num_experts or sum(splits.counts) != x.shape[0]:
            raise ValueError(
                f"{self.names[0]}: tokens_per_expert {splits.counts} (from local expert {e0}) "
                f"does not fit {self.num_experts} local experts and {x.shape[0]} rows")
        a, b, offset = self.factors()
        if e0 or num != self.num_experts:
            a, b = a[e0:e0 + num], b[e0:e0 + num]
        p = self.dropout()
        keys = None
        if p > 0.0:
            if key is None or token_ids is None or token_ids.numel() != x.shape[0]:
                raise ValueError(
                    f"{self.names[0]}: dropout {p} in training needs token_ids (the global token "
                    f"index of each of the {x.shape[0]} rows) and the MoE layer's key; wrap the "
                    "experts with wrap_experts(..., moe_layer=layer) (token_route.py)")
            keys = expert_keys(key, self.first_expert + e0, num, 0 if self.kind == "linear_fc1"
                               else 1)
        scale = self.scales[e0] if self.uniform_scale else 1.0
        u = grouped_linear(x, a, splits, scale, p, keys, offset, token_ids)  # [n, r]
        if not self.uniform_scale:  # s_e on each row of expert e, as the per-expert product
            rows = torch.repeat_interleave(self.scale_vector[e0:e0 + num], _counts_on(splits),
                                           output_size=x.shape[0])
            u = u * rows.unsqueeze(1).to(u.dtype)
        return grouped_linear(u, b, splits)

    def open_call(self) -> None:
        """An experts call begins: per-expert views are made on first use and shared by its
        experts (one unbind per factor, whose backward is one stack)."""
        self._call = {}

    def close_call(self) -> None:
        self._call = None

    def _views(self):
        call = self._call
        if call is None:  # used outside an experts call: fresh views each time
            call = {}
        if "ab" not in call:
            a, b, offset = self.factors()
            call["ab"] = (a.unbind(0), b.unbind(0), offset)
        return call["ab"]

    def expert_term(self, e: int, x: torch.Tensor, add_to=None, drop=None) -> torch.Tensor:
        """s_e drop(x) A_e^T B_e^T (+ add_to) for local expert e's rows x [n, in_local]:
        [n, out_local] (fc2: partial over expert-TP). drop: (p, key, token ids) or None."""
        a, b, offset = self._views()
        p, key, ids = drop if drop is not None else (0.0, None, None)
        u = lora_down(x, a[e], self.scales[e], p, key, 0, offset, ids)
        return up_projection(u, b[e], add_to)

    # ---------------------------------------------------------------------------------------
    # DoRA
    # ---------------------------------------------------------------------------------------
    def weight_norms(self) -> torch.Tensor:
        """fp32 [E, out_local] = ||W_e + s_e B_e A_e||_row for every local expert, detached;
        fc2: one all-reduce of the squared norms over expert-TP. Formed once per training step
        (dora.begin_step .. end_step), every call outside one."""
        return D.step_cached(self, self._weight_norms)

    @torch.no_grad()
    def _weight_norms(self) -> torch.Tensor:
        sq = torch.stack([D.squared_row_norms(D.base_weight(base), self.lora_A[e],
                                              self.lora_B[e], self.scales[e])
                          for e, base in enumerate(self.bases)])
        return D.complete_squared_norms(sq, self.geometry).sqrt_()

    def dora_scales(self) -> torch.Tensor:
        """m / n [E, out_local] (n detached); fc2's m gradient summed over expert-TP."""
        m = self.magnitude
        if self.geometry.mode != COLUMN:
            m = C.grad_sum(m, self.geometry.tp_group)
        return m / self.weight_norms().to(m.dtype)

    def call_dora_scales(self):
        """dora_scales() split per local expert, formed once per experts call."""
        call = self._call if self._call is not None else {}
        if "dora" not in call:
            call["dora"] = self.dora_scales().unbind(0)
        return call["dora"]

    def expert_dora(self, e: int, x, output, scale, base_fn, added_bias=None, drop=None):
        """Local expert e's DoRA output (PEFT's formula, dora.py) on its rows: output [n, out]
        its base output, scale its m/n [out_local], base_fn(d) its base on another input."""
        p, key, ids = drop if drop is not None else (0.0, None, None)
        if p == 0.0:
            base_result = output if added_bias is None else output - added_bias
            out = self.expert_term(e, x, add_to=base_result) * scale.to(output.dtype)
            return out if added_bias is None else out + added_bias
        lora = self.expert_term(e, x, drop=drop)
        g = self.geometry
        feat0 = 0 if g.mode == COLUMN else g.tp_rank * g.in_local
        base_result = base_fn(D.dropped_input(x, p, key, 0, feat0, ids))
        if added_bias is not None:
            base_result = base_result - added_bias
        return D.combine(output, base_result, lora, scale)

    # ---------------------------------------------------------------------------------------
    # merge / disable
    # ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def merge(self, safe: bool = False) -> None:
        """W_e += s_e B_e A_e (DoRA: W_e <- m_e/n_e (W_e + s_e B_e A_e)) for every local expert,
        in place, rounded once into the weight's dtype. safe: every rank of the expert-TP group
        checks first that all updates and merged weights are finite (one all-reduce); on failure
        every weight is left bit-identical and ValueError is raised everywhere."""
        if self.merged:
            warnings.warn("ExpertLora.merge: already merged; nothing to do", stacklevel=2)
            return
        if any(getattr(base, "nf4", False) for base in self.bases):
            raise ValueError(
                "ExpertLora.merge: the experts are held in NF4 (--base-quantization nf4); merge "
                "onto the full-precision base instead (export hf --merge loads it)")
        norms = list(self._weight_norms()) if self.magnitude is not None else None
        if safe:
            ok = all(bool(torch.isfinite(new).all()) for new in self._merged_weights(norms))
            device = self.lora_A.device
            if not M.all_ranks_agree(ok, self.geometry.tp_group, device):
                raise ValueError(
                    f"ExpertLora.safe_merge ({self.names[0]} ...): an update or merged weight "
                    "has non-finite values on at least one rank; the base weights were left "
                    "unchanged")
        for base, new in zip(self.bases, self._merged_weights(norms)):
            base.weight.copy_(new.to(base.weight.dtype))
        self._merge_norms = norms
        self.merged = True

    def _merged_weights(self, norms):
        for e, base in enumerate(self.bases):
            merged = base.weight.float() + M.delta_weight(self.expert(e))
            if norms is not None:
                merged = (self.magnitude[e].float() / norms[e]).unsqueeze(1) * merged
            yield merged

    @torch.no_grad()
    def unmerge(self) -> None:
        """Take the merged update out of every local expert's weight (merge's inverse)."""
        if not self.merged:
            warnings.warn("ExpertLora.unmerge: not merged; nothing to do", stacklevel=2)
            return
        for e, base in enumerate(self.bases):
            w = base.weight.float()
            if self._merge_norms is not None:
                w = w / (self.magnitude[e].float() / self._merge_norms[e]).unsqueeze(1)
            base.weight.copy_((w - M.delta_weight(self.expert(e))).to(base.weight.dtype))
        self._merge_norms = None
        self.merged = False

    @contextlib.contextmanager
    def disable_adapters(self):
        """Within the context the experts compute their base layers alone."""
        if self.merged:
            raise RuntimeError("ExpertLora.disable_adapters: merged into the base weights; "
                               "unmerge() first")
        previous, self._disabled = self._disabled, True
        try:
            yield self
        finally:
            self._disabled = previous

    def extra_repr(self) -> str:
        scales = (f"scaling={self.scales[0]:g}" if self.uniform_scale
                  else f"scalings={min(self.scales):g}..{max(self.scales):g}")
        return (f"{self.num_experts} experts from {self.first_expert}, "
                f"{self.geometry.describe()}, rank={self.rank}, {scales}, "
                f"dropout={self.config.dropout}, merged={self.merged}"
                + (", dora" if self.magnitude is not None else ""))


def _counts_on(splits: Splits) -> torch.Tensor:
    """The splits' row counts as an int64 tensor on their device (from the offsets)."""
    offs = splits.offsets().to(torch.int64)
    return torch.diff(offs, prepend=offs.new_zeros(1))


__all__ = ["ExpertLora", "ExpertView"]  # ExpertView re-exported
