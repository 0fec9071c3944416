"""Helpers for the LoRA parity tests: one layer case at one layout vs a single-process reference.

`run_case(case)` (on every rank of an initialised megatron world) builds a megatron column/row
parallel linear and a LoraAdapter with non-zero B, runs forward and backward on a slice of a
global batch, reduces gradients the way megatron's finalize_model_grads does, gathers the global
weights and factors, recomputes everything in plain torch on the global tensors and returns the
names of the quantities that differ (empty list: the layout is exact).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Dict, List

import torch
import torch.distributed as dist
from megatron.core import ModelParallelConfig, parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lora.lora import AdapterConfig, LoraAdapter, draw_dropout_key, keep_mask
from tests.lora._bounds import judge, shadow_bound

IN, OUT, RANK, SEQ, BATCH = 24, 16, 4, 8, 2
ALPHA = 8.0
# Roundings along the longest chain of any compared quantity: IN (x W) or IN + RANK + OUT (the
# LoRA path and its backward), SEQ * BATCH (a weight gradient's sum over tokens), a few adds,
# scales and the dropout rescale; the loss adds its sum over SEQ * BATCH * OUT products.
CHAIN = SEQ * BATCH + IN + OUT + RANK + 4
LOSS_CHAIN = CHAIN + SEQ * BATCH * OUT


def lora_scale(alpha: float, rank: int, use_rslora: bool) -> float:
    """The LoRA scale from the hyper-parameters alone (never from the code under test):
    alpha / r, or alpha / sqrt(r) with rsLoRA (at r = 4: 2 vs 4)."""
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


@dataclass(frozen=True)
class Case:
    mode: str  # "column" | "row"
    sp: bool = False
    gather_output: bool = False  # column
    input_is_parallel: bool = True  # row
    bias: bool = True
    skip_bias_add: bool = False
    dropout: float = 0.0
    train_base_weight: bool = False
    finalize: bool = True  # reduce SP-partial grads over TP as finalize_model_grads does
    ddp: bool = False  # wrap in megatron DDP and call finalize_model_grads itself
    te_style: bool = False  # wrap the base in a shim exposing only TE-style attributes
    rslora: bool = False  # scale alpha / sqrt(r)

    def name(self) -> str:
        parts = [self.mode, "sp" if self.sp else "nosp"]
        if self.mode == "column" and self.gather_output:
            parts.append("gather")
        if self.mode == "row" and not self.input_is_parallel:
            parts.append("input-replicated")
        parts += ["bias" if self.bias else "nobias"] + (["skip"] if self.skip_bias_add else [])
        if self.dropout:
            parts.append(f"p{self.dropout}")
        if self.rslora:
            parts.append("rslora")
        if self.train_base_weight:
            parts.append("trainW")
        if self.ddp:
            parts.append("ddp+finalize_model_grads")
        if self.te_style:
            parts.append("te-style")
        return "/".join(parts)


def all_cases(tp: int, dropouts=(0.0, 0.25)) -> List[Case]:
    """Every supported combination at tensor-parallel size tp (SP needs tp > 1)."""
    out = []
    for sp in ([False, True] if tp > 1 else [False]):
        for bias in (False, True):
            for skip in (False, True):
                for p in dropouts:
                    # Every dropout case also scales by rsLoRA; the p = 0 ones by alpha / r.
                    rs = p > 0
                    for gather in (False, True):
                        out.append(Case("column", sp, gather, True, bias, skip, p, rslora=rs))
                    for parallel_in in ([True] if sp else [True, False]):
                        out.append(Case("row", sp, False, parallel_in, bias, skip, p, rslora=rs))
        # A trainable base weight: megatron's other linear path (it also trains a column bias).
        for gather in (False, True):
            out.append(Case("column", sp, gather, True, True, False, train_base_weight=True))
        for parallel_in in ([True] if sp else [True, False]):
            out.append(Case("row", sp, False, parallel_in, True, False, train_base_weight=True))
        if sp:
            # The real thing: megatron DDP (main_grad buffers) + finalize_model_grads.
            out.append(Case("column", True, False, True, True, True, 0.25, ddp=True, rslora=True))
            out.append(Case("row", True, False, True, True, False, 0.25, ddp=True, rslora=True))
        if tp > 1:
            # A base described only by parallel_mode / in_features / tp_group (TE's attributes).
            for p in (0.0, 0.25):
                out.append(Case("column", sp, False, True, True, True, p, te_style=True,
                                rslora=p > 0))
                out.append(Case("row", sp, False, True, True, False, p, te_style=True,
                                rslora=p > 0))
    return out


def tp_group():
    return parallel_state.get_tensor_model_parallel_group()


def tp_rank_size():
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Concatenate every TP rank's `t` along dim (test-side only)."""
    rank, size = tp_rank_size()
    if size == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.detach().contiguous(), group=tp_group())
    return torch.cat(parts, dim=dim)


def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
    rank, size = tp_rank_size()
    part = t.shape[dim] // size
    return t.narrow(dim, rank * part, part)


def finalize_tp_grads(module: torch.nn.Module, config: ModelParallelConfig) -> None:
    """The TP step of megatron's finalize_model_grads (_allreduce_non_tensor_model_parallel_grads):
    sum, over the TP group, the gradients of parameters marked `sequence_parallel` when the model
    runs with sequence parallelism. Called through megatron's own function."""
    import importlib

    from megatron.core.distributed import DistributedDataParallelConfig

    # The package re-exports the function under the module's name; import the module itself.
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    class _Chunk(torch.nn.Module):  # what the function expects of a model chunk
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.ddp_config = DistributedDataParallelConfig()

    fmg._allreduce_non_tensor_model_parallel_grads([_Chunk(module)], config, tp_group())


class TEStyleLinear(torch.nn.Module):
    """Stands in for a Transformer Engine linear: it is no megatron ColumnParallelLinear /
    RowParallelLinear and exposes only TE's attribute names (parallel_mode, in_features,
    out_features, tp_group, tp_size, sequence_parallel); the arithmetic is the wrapped megatron
    layer's, so the reference comparison still applies."""

    def __init__(self, inner, mode: str):
        super().__init__()
        self._inner = [inner]  # not a submodule: the adapter must not find megatron attributes
        self.parallel_mode = mode
        self.in_features = inner.input_size
        self.out_features = inner.output_size
        self.tp_group = inner.tp_group
        self.tp_size = dist.get_world_size(inner.tp_group)
        self.sequence_parallel = inner.sequence_parallel
        self.weight = inner.weight
        self.bias = inner.bias

    def forward(self, x):
        return self._inner[0](x)


def build(case: Case, tp: int, seed: int = 7, adapter_seed: int = 11, dtype=torch.float32):
    """Base layer with the same global weight and bias at any layout, and its adapter."""
    # A TransformerConfig (a ModelParallelConfig) because finalize_model_grads reads its fields.
    config = TransformerConfig(
        num_layers=1, hidden_size=IN, num_attention_heads=4,
        tensor_model_parallel_size=tp, sequence_parallel=case.sp,
        use_cpu_initialization=True, params_dtype=dtype,
    )
    # megatron initialises the global weight from the default generator and slices it.
    torch.manual_seed(seed)
    init = lambda w: torch.nn.init.normal_(w, std=0.2)  # noqa: E731
    if case.mode == "column":
        base = ColumnParallelLinear(
            IN, OUT, config=config, init_method=init, bias=case.bias,
            gather_output=case.gather_output, skip_bias_add=case.skip_bias_add,
        )
    else:
        base = RowParallelLinear(
            IN, OUT, config=config, init_method=init, bias=case.bias,
            input_is_parallel=case.input_is_parallel, skip_bias_add=case.skip_bias_add,
        )
    if case.bias:
        g = torch.Generator().manual_seed(seed + 1)
        global_bias = torch.randn(OUT, generator=g)
        with torch.no_grad():
            base.bias.copy_(shard(global_bias, 0) if case.mode == "column" else global_bias)
    if case.te_style:
        base = TEStyleLinear(base, case.mode)
    adapter = LoraAdapter(
        base, AdapterConfig(rank=RANK, alpha=ALPHA, dropout=case.dropout, init_lora_weights=False,
                            use_rslora=case.rslora),
        seed=adapter_seed,
    )
    if case.bias:
        base.bias.requires_grad_(True)
    if case.train_base_weight:
        base.weight.requires_grad_(True)
    return config, base, adapter


def global_batch(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ, BATCH, IN, generator=g)
    grad_out = torch.randn(SEQ, BATCH, OUT, generator=g)
    grad_bias = torch.randn(OUT, generator=g)
    return x, grad_out, grad_bias


def local_input(case: Case, x: torch.Tensor) -> torch.Tensor:
    if case.mode == "column":
        return shard(x, 0) if case.sp else x
    return shard(x, 2) if case.input_is_parallel else x


def local_output(case: Case, y: torch.Tensor) -> torch.Tensor:
    if case.mode == "column":
        return y if case.gather_output else shard(y, 2)
    return shard(y, 0) if case.sp else y


def output_is_replicated(case: Case) -> bool:
    return (case.mode == "column" and case.gather_output) or (case.mode == "row" and not case.sp)


def run_case(case: Case, tp: int) -> Dict[str, object]:
    """Run one case; returns {"failures": [...names...], "errors": {name: why it failed: the worst
    element, its index and its bound}}."""
    config, base, adapter = build(case, tp)
    x_global, g_out, g_bias = global_batch()
    x = local_input(case, x_global).clone().requires_grad_(True)
    model = adapter
    if case.ddp:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        model = DistributedDataParallel(config, DistributedDataParallelConfig(), module=adapter)
    rng = torch.get_rng_state()
    out, bias_ret = model(x)
    key = None
    if case.dropout:
        after = torch.get_rng_state()
        torch.set_rng_state(rng)
        key = draw_dropout_key(torch.device("cpu"))  # the key the adapter drew
        torch.set_rng_state(after)

    # The caller's loss: add a skipped bias where the shapes allow it (a column layer that
    # gathers its output returns the bias shard, which the caller must gather itself).
    bias_separate = case.skip_bias_add and case.bias and case.mode == "column" and case.gather_output
    total = out + bias_ret if (bias_ret is not None and not bias_separate) else out
    replicated_part = torch.zeros(())
    partial_part = torch.zeros(())
    out_term = (total * local_output(case, g_out)).sum()
    if output_is_replicated(case):
        replicated_part = replicated_part + out_term
    else:
        partial_part = partial_part + out_term
    if bias_separate:
        partial_part = partial_part + (bias_ret * shard(g_bias, 0)).sum()
    (replicated_part + partial_part).backward()
    if case.ddp:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([model])
    elif case.finalize:
        finalize_tp_grads(adapter, config)
    loss = replicated_part.detach() + _sum_over_tp(partial_part.detach())

    # ---- single-process reference from the gathered global tensors and the config ----
    col = case.mode == "column"
    w = gather(base.weight, 0 if col else 1).requires_grad_(True)
    a = (adapter.lora_A.detach().clone() if col else gather(adapter.lora_A, 1)).requires_grad_(True)
    b = (gather(adapter.lora_B, 0) if col else adapter.lora_B.detach().clone()).requires_grad_(True)
    gb = None
    if case.bias:
        gb = (gather(base.bias, 0) if col else base.bias.detach().clone()).requires_grad_(True)
    xr = x_global.clone().requires_grad_(True)
    scale = lora_scale(ALPHA, RANK, case.rslora)

    def reference(w, a, b, gb, xr, mask, g_out, g_bias):
        xd = xr if mask is None else xr * mask / (1.0 - case.dropout)
        y = xr @ w.t() + scale * ((xd @ a.t()) @ b.t())
        ref_out = y + gb if (case.bias and not case.skip_bias_add) else y
        ref_total = (ref_out + gb if (case.bias and case.skip_bias_add and not bias_separate)
                     else ref_out)
        ref_loss = (ref_total * g_out).sum()
        if bias_separate:
            ref_loss = ref_loss + (gb * g_bias).sum()
        ref_loss.backward()
        return ref_out, ref_loss

    mask = None
    if case.dropout:
        # The global mask of the documented hash: tokens are the flattened [s, b] positions.
        mask = keep_mask(key, case.dropout, 0, SEQ * BATCH, 0, IN).reshape(SEQ, BATCH, IN)
    ref_out, ref_loss = reference(w, a, b, gb, xr, mask, g_out, g_bias)
    # The same graph on the leaves' absolute values: every op is a sum or a product with a
    # non-negative constant (scale, 1 / (1 - p), the 0/1 mask), so each of its values and
    # gradients is the sum of the absolute values of the terms the compared one adds up.
    leaves = [None if t is None else t.detach().abs().requires_grad_(True) for t in (w, a, b, gb)]
    abs_x = xr.detach().abs().requires_grad_(True)
    abs_out, abs_loss = reference(*leaves, abs_x, mask, g_out.abs(), g_bias.abs())
    abs_w, abs_a, abs_b, abs_gb = leaves

    checks = {  # name: (layer's, reference's, the reference's absolute-value shadow)
        "output": (out, local_output(case, ref_out), local_output(case, abs_out)),
        "loss": (loss, ref_loss.detach(), abs_loss),
        "grad_input": (x.grad, local_input(case, xr.grad), local_input(case, abs_x.grad)),
        "grad_A": (_grad(adapter.lora_A), a.grad if col else shard(a.grad, 1),
                   abs_a.grad if col else shard(abs_a.grad, 1)),
        "grad_B": (_grad(adapter.lora_B), shard(b.grad, 0) if col else b.grad,
                   shard(abs_b.grad, 0) if col else abs_b.grad),
    }
    if case.bias and (_grad(base.bias) is not None or case.skip_bias_add or not col
                      or case.train_base_weight):
        # megatron-core's frozen-weight linear (LinearWithFrozenWeight) adds a non-skipped column
        # bias inside its autograd function and returns no gradient for it: with a frozen base
        # weight that bias cannot train (a megatron limitation, not the adapter's).
        checks["grad_bias"] = (_grad(base.bias), shard(gb.grad, 0) if col else gb.grad,
                               shard(abs_gb.grad, 0) if col else abs_gb.grad)
    if case.train_base_weight:
        checks["grad_base_weight"] = (_grad(base.weight), shard(w.grad, 0 if col else 1),
                                      shard(abs_w.grad, 0 if col else 1))
    failures, errors = [], {}
    for name, (got, want, shadow) in checks.items():
        # Within 2 gamma_n S per element (tests/lora/_bounds.py): n = CHAIN (LOSS_CHAIN for the
        # loss), S = the shadow.
        bound = shadow_bound(LOSS_CHAIN if name == "loss" else CHAIN, shadow)
        why = judge(got, want, bound, f"dense/{name}")
        if why:
            failures.append(name)
            errors[name] = why
    if case.skip_bias_add and case.bias and bias_ret is not base.bias:
        failures.append("returned_bias")
    if (not case.skip_bias_add or not case.bias) and bias_ret is not None:
        failures.append("returned_bias")
    return {"failures": failures, "errors": errors}


def _grad(p: torch.nn.Parameter):
    """The gradient megatron's optimizer would read: DDP's main_grad buffer, else .grad."""
    if hasattr(p, "main_grad") and p.main_grad is not None:
        return p.main_grad
    return p.grad


def _sum_over_tp(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    if tp_rank_size()[1] > 1:
        dist.all_reduce(t, group=tp_group())
    return t


@contextlib.contextmanager
def patched(cls, name: str, fn):
    """Temporarily replace a staticmethod of an autograd Function (to switch a reduction off)."""
    original = cls.__dict__[name]
    setattr(cls, name, staticmethod(fn))
    try:
        yield
    finally:
        setattr(cls, name, original)


__all__ = ["Case", "all_cases", "build", "run_case", "patched", "replace"]
