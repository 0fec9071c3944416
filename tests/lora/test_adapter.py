"""LoraAdapter behaviour beyond the parity matrix: configuration errors, merge/unmerge,
safe_merge, disable_adapters, dropout across layouts, dtype, saved activations, collectives,
and distributed checkpoints across TP sizes."""

import math
import warnings

import pytest
import torch
import torch.distributed as dist

from megatron_lora.lora import AdapterConfig, keep_mask
from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank

# ------------------------------------------------------------------------------------------
# single process: configuration and the dropout mask
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(rank=0, alpha=8), "rank"),
        (dict(rank=-2, alpha=8), "rank"),
        (dict(rank=2.5, alpha=8), "rank"),
        (dict(rank=4, alpha=0), "alpha"),
        (dict(rank=4, alpha=-1.0), "alpha"),
        (dict(rank=4, alpha=math.nan), "alpha"),
        (dict(rank=4, alpha=8, dropout=-0.1), "dropout"),
        (dict(rank=4, alpha=8, dropout=1.0), "dropout"),
        (dict(rank=4, alpha=8, init_lora_weights="orthogonal"), "init_lora_weights"),
        (dict(rank=4, alpha=8, dtype=torch.int8), "dtype"),
        (dict(rank=4, alpha=8, use_rslora="yes"), "use_rslora"),
    ],
)
def test_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"AdapterConfig\.{field}\b"):
        AdapterConfig(**kwargs)


def test_config_scaling_and_immutability():
    assert AdapterConfig(rank=16, alpha=32).scaling == 2.0
    assert AdapterConfig(rank=16, alpha=32, use_rslora=True).scaling == 8.0
    config = AdapterConfig(rank=4, alpha=8)
    with pytest.raises(Exception):
        config.rank = 8  # frozen: nobody (the adapter included) can change a caller's config


def test_dropout_mask_is_a_slice_of_the_global_mask_and_has_rate_p():
    key = torch.tensor([12345, 67890])
    full = keep_mask(key, 0.1, 0, 64, 0, 96)
    # any shard's mask is the slice of the global mask (sequence shards, feature shards)
    assert torch.equal(keep_mask(key, 0.1, 16, 16, 0, 96), full[16:32])
    assert torch.equal(keep_mask(key, 0.1, 0, 64, 48, 48), full[:, 48:])
    big = keep_mask(key, 0.1, 0, 2048, 0, 1024)
    assert abs(big.float().mean().item() - 0.9) < 0.002
    # no structure along either axis: per-row and per-column keep rates stay near 0.9
    assert big.float().mean(1).std().item() < 0.02 and big.float().mean(0).std().item() < 0.02
    # neighbouring tokens / features are independent (agreement rate of two p=0.1 masks: 0.82)
    agree = (big[1:] == big[:-1]).float().mean().item()
    assert abs(agree - 0.82) < 0.005
    agree = (big[:, 1:] == big[:, :-1]).float().mean().item()
    assert abs(agree - 0.82) < 0.005
    other = keep_mask(torch.tensor([12346, 67890]), 0.1, 0, 2048, 0, 1024)
    assert abs((big == other).float().mean().item() - 0.82) < 0.005
    assert keep_mask(key, 0.0, 0, 8, 0, 8).all()


# ------------------------------------------------------------------------------------------
# multi-rank
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2)], ids=["TP2"])
@multirank(world_size=2, timeout=300)
def test_bad_input_raises_naming_the_argument_before_any_collective(layout):
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from megatron_lora.lora import LoraAdapter, UnsupportedBaseLayerError
    from megatron_lora.lora.accounting import record_collectives
    from tests.lora._support import Case, build

    config, column, _ = build(Case("column", sp=True), 2)
    _, row, _ = build(Case("row", sp=False), 2)

    class Duplicated(torch.nn.Module):  # TE-style attribute, but a mode we cannot shard exactly
        parallel_mode = "duplicated"

    partial = ColumnParallelLinear(
        24, 16, config=config, init_method=torch.nn.init.zeros_, bias=False,
        disable_grad_reduce=True,
    )  # input gradient left partial for an unknown party (experts are handled: test_moe_*)
    bad = [
        (lambda: LoraAdapter(column, AdapterConfig(rank=0, alpha=8)), ValueError, r"\.rank\b"),
        (lambda: LoraAdapter(row, AdapterConfig(rank=17, alpha=8)), ValueError,
         r"AdapterConfig\.rank=17 is larger than min\(in_features, out_features\)"),
        (lambda: LoraAdapter(column, AdapterConfig(rank=4, alpha=-1)), ValueError, r"\.alpha\b"),
        (lambda: LoraAdapter(row, AdapterConfig(rank=4, alpha=8, dropout=1.5)), ValueError,
         r"\.dropout\b"),
        (lambda: LoraAdapter(column, AdapterConfig(rank=4, alpha=8, dropout=-0.5)), ValueError,
         r"\.dropout\b"),
        (lambda: LoraAdapter(torch.nn.Linear(24, 16), AdapterConfig(rank=4, alpha=8)),
         UnsupportedBaseLayerError, r"base_layer of type Linear"),
        (lambda: LoraAdapter(Duplicated(), AdapterConfig(rank=4, alpha=8)),
         UnsupportedBaseLayerError, r"base_layer Duplicated has parallel_mode='duplicated'"),
        (lambda: LoraAdapter(partial, AdapterConfig(rank=4, alpha=8)),
         UnsupportedBaseLayerError, r"base_layer ColumnParallelLinear has disable_grad_reduce"),
        (lambda: LoraAdapter(column, {"rank": 4}), TypeError, r"config must be an AdapterConfig"),
    ]
    with record_collectives() as calls:
        for make, error, pattern in bad:
            with pytest.raises(error, match=pattern):
                make()
    assert calls == [], f"collectives were issued while rejecting bad input: {calls}"


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2)], ids=["TP2"])
@multirank(world_size=2, timeout=300)
def test_merge_unmerge_safe_merge_and_disable(layout):
    from tests.lora._bounds import judge, shadow_bound
    from tests.lora._support import (ALPHA, IN, RANK, Case, build, gather, global_batch,
                                     local_input, local_output, lora_scale)

    def check(got, want, bound, what):
        why = judge(got, want, bound, what)
        assert why is None, why

    scale = lora_scale(ALPHA, RANK, False)
    for case in (Case("column", sp=True), Case("column", gather_output=True), Case("row"),
                 Case("row", sp=True), Case("row", input_is_parallel=False)):
        _, base, adapter = build(case, 2)
        adapter.eval()
        x_global = global_batch()[0]
        x = local_input(case, x_global)
        original = base.weight.detach().clone()
        # Shadows (tests/lora/_bounds.py): S_w = |W| + scale |B| |A| per element of the local
        # weight, and S_y = |x| S_w^T + |bias| per element of the output, from the global tensors.
        # Merged, an output element is x (W + scale B A)^T + bias: the merged weight is rounded
        # along RANK + 2 operations, the product along IN (split over TP ranks and all-reduced),
        # plus the bias add; unmerged it is x W^T + scale (x A^T) B^T + bias, IN + RANK + 2
        # roundings. Each is within gamma_n S_y of the exact value, n = IN + RANK + 4, so they
        # differ by at most 2 gamma_n S_y. unmerge computes (W + D) - D with D = scale B A
        # rounded along RANK + 1 operations each time: within 2 gamma_(RANK + 4) S_w of W.
        col = case.mode == "column"
        with torch.no_grad():
            s_w = base.weight.abs() + scale * adapter.lora_B.abs() @ adapter.lora_A.abs()
            s_w_global = gather(s_w, 0 if col else 1)
            s_bias = gather(base.bias, 0) if col else base.bias
            s_y = local_output(case, x_global.abs() @ s_w_global.t() + s_bias.abs())
        out_bound = shadow_bound(IN + RANK + 4, s_y)
        weight_bound = shadow_bound(RANK + 4, s_w)
        with torch.no_grad():
            with_lora = adapter(x)[0]
            plain = base(x)[0]
            with adapter.disable_adapters():
                assert torch.equal(adapter(x)[0], plain)
            assert (with_lora - plain).abs().max() > 1e-2  # the update is not negligible

            adapter.merge()
            merged_weight = base.weight.detach().clone()
            check(adapter(x)[0], with_lora, out_bound, f"{case.name()} merged adapter output")
            check(base(x)[0], with_lora, out_bound, f"{case.name()} merged base output")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                adapter.merge()  # idempotent
            assert any("already merged" in str(w.message) for w in caught)
            assert torch.equal(base.weight, merged_weight)
            with pytest.raises(RuntimeError, match="unmerge"):
                with adapter.disable_adapters():
                    pass

            adapter.unmerge()
            check(base.weight, original, weight_bound, f"{case.name()} unmerged weight")
            check(adapter(x)[0], with_lora, out_bound, f"{case.name()} unmerged output")

            # safe_merge: a non-finite factor on one rank only; every rank refuses, and the base
            # stays bit-identical everywhere (no rank merges alone).
            before = base.weight.detach().clone()
            if dist.get_rank() == 1:
                adapter.lora_B[0, 0] = float("nan")
            with pytest.raises(ValueError, match="non-finite"):
                adapter.safe_merge()
            assert torch.equal(base.weight, before) and not adapter.merged
            adapter.lora_B.nan_to_num_(0.0)
            adapter.safe_merge()
            assert adapter.merged


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2)], ids=["TP2"])
@multirank(world_size=2, timeout=300)
def test_same_seed_gives_same_global_factors_and_dropout_at_every_layout(layout):
    """TP2 (with and without SP) against TP1 in the same processes: global factors, LoRA output
    with dropout (same seed), and a recomputed forward (RNG state restored) are identical."""
    from megatron_lora import runtime
    from megatron_lora.lora import init_global_factors
    from tests.lora._support import IN, OUT, Case, build, gather, global_batch, local_input

    p = 0.3
    layouts = {  # label -> case at TP2 ; the TP1 case is the same base without SP
        "column+SP": Case("column", sp=True, dropout=p),
        "column": Case("column", dropout=p),
        "row+SP": Case("row", sp=True, dropout=p),
        "row (replicated input)": Case("row", input_is_parallel=False, dropout=p),
    }
    deltas = {}
    for tp in (2, 1):
        runtime.initialize(ParallelLayout(tp=tp), seed=99)
        for label, case in layouts.items():
            if tp == 1:
                case = Case(case.mode, input_is_parallel=case.input_is_parallel, dropout=p)
            _, base, adapter = build(case, tp)
            col = case.mode == "column"
            a = adapter.lora_A.detach() if col else gather(adapter.lora_A, 1)
            b = gather(adapter.lora_B, 0) if col else adapter.lora_B.detach()
            want_a, want_b = init_global_factors(adapter.config, IN, OUT, seed=11)
            assert torch.equal(a, want_a) and torch.equal(b, want_b), label
            x = local_input(case, global_batch()[0])
            state = torch.get_rng_state()
            with torch.no_grad():
                delta = adapter.lora_delta(x)
                torch.set_rng_state(state)  # what activation recomputation does
                assert torch.equal(adapter.lora_delta(x), delta), label
                assert not torch.equal(adapter.lora_delta(x), delta), label  # next key
            if col:  # back to the global [s, b, out] tensor
                delta = gather(delta, 2)
            elif case.sp:
                delta = gather(delta, 0)
            deltas[label, tp] = delta
    # scale * dropout(x) A^T B^T at TP2 and TP1: the same products (the same mask) summed in
    # other orders, IN + RANK + 3 roundings (the sums, the mask's 1 / (1 - p), the scale); each
    # within gamma_n S of the exact value, S = scale / (1 - p) |x| |A|^T |B|^T (the masked-out
    # terms only lower the true S), so they differ by at most 2 gamma_n S (tests/lora/_bounds.py).
    from tests.lora._bounds import judge, shadow_bound
    from tests.lora._support import ALPHA, RANK, lora_scale

    # want_a, want_b: the global factors every layout above was checked to hold
    shadow = (lora_scale(ALPHA, RANK, False) / (1 - p)
              * (global_batch()[0].abs() @ want_a.abs().t()) @ want_b.abs().t())
    for label in layouts:
        why = judge(deltas[label, 2], deltas[label, 1], shadow_bound(IN + RANK + 3, shadow),
                    f"{label}: TP2 vs TP1 LoRA delta")
        assert why is None, why


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2)], ids=["TP2"])
@multirank(world_size=2, timeout=300)
def test_saved_activations_collectives_and_dtypes(layout):
    """What backward keeps is the input at the base's own sharding plus [T, r]; the LoRA path's
    collectives are all [T, r] (or one factor); bf16 activations stay bf16 with fp32 factors;
    the base's megatron config is untouched."""
    from megatron_lora.lora import LoraAdapter
    from megatron_lora.lora.accounting import record_collectives, record_saved_tensors
    from tests.lora._support import BATCH, IN, RANK, SEQ, Case, build, global_batch
    from tests.lora._support import local_input

    t = 2
    tokens = SEQ * BATCH
    for case, x_bytes, u_tokens in (
        (Case("column", sp=True, bias=False, dropout=0.2), tokens // t * IN * 4, tokens),
        (Case("column", bias=False), tokens * IN * 4, tokens),
        (Case("row", sp=True, bias=False, dropout=0.2), tokens * IN // t * 4, tokens // t),
        (Case("row", bias=False), tokens * IN // t * 4, tokens),
    ):
        config, base, adapter = build(case, t)
        x = local_input(case, global_batch()[0]).clone().requires_grad_(True)
        params = list(adapter.parameters())
        with record_saved_tensors(exclude=params) as base_saved:
            base(x)[0].sum().backward()
        with record_saved_tensors(exclude=params) as saved, record_collectives() as calls:
            adapter(x)[0].sum().backward()
        extra = sum(s.nbytes for s in saved) - sum(s.nbytes for s in base_saved)
        assert extra == x_bytes + u_tokens * RANK * 4, (case.name(), saved, base_saved)
        # base-only collectives have a hidden-sized last dim; every extra one ends in r
        with record_collectives() as base_calls:
            base(x)[0].sum().backward()
        lora_calls = list(calls)
        for c in base_calls:
            lora_calls.remove(c)
        assert lora_calls and all(c.last_dim == RANK for c in lora_calls), lora_calls

    # dtype: bf16 activations, fp32 factors, bf16 base
    case = Case("column", sp=True, bias=False, dropout=0.2)
    config, base, _ = build(case, t, dtype=torch.bfloat16)
    before = dict(vars(config))
    adapter = LoraAdapter(base, AdapterConfig(rank=RANK, alpha=8.0, dropout=0.2,
                                              init_lora_weights=False, dtype=torch.float32))
    changed = [k for k, v in vars(config).items() if k not in before or before[k] is not v]
    assert not changed and len(vars(config)) == len(before), changed  # caller's config untouched
    assert adapter.lora_A.dtype == adapter.lora_B.dtype == torch.float32
    x = local_input(case, global_batch()[0]).to(torch.bfloat16).requires_grad_(True)
    with record_saved_tensors(exclude=list(adapter.parameters())) as saved:
        out, _ = adapter(x)
    assert out.dtype == torch.bfloat16
    activation_like = [s for s in saved if s.shape and s.shape[0] in (SEQ, SEQ // t)]
    assert activation_like and all(s.dtype == torch.bfloat16 for s in activation_like), saved
    out.float().sum().backward()
    assert adapter.lora_A.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2, sp=True)], ids=["TP2"])
@multirank(world_size=2, timeout=300)
def test_checkpoint_saved_at_tp2_loads_at_tp1(tmp_path, layout):
    from megatron.core import dist_checkpointing, parallel_state

    from megatron_lora import runtime
    from tests.lora._support import Case, build, gather

    directory = str(tmp_path / "ckpt")
    saved = {}
    for case in (Case("column", sp=True), Case("row", sp=True)):
        runtime.initialize(ParallelLayout(tp=2), seed=5)
        _, base, adapter = build(case, 2, adapter_seed=21)
        with torch.no_grad():  # trained-looking factors, different from any seed's init
            adapter.lora_A.mul_(1.5).add_(0.25)
            adapter.lora_B.mul_(-2.0).sub_(0.5)
        col = case.mode == "column"
        saved = {
            "A": adapter.lora_A.detach().clone() if col else gather(adapter.lora_A, 1),
            "B": gather(adapter.lora_B, 0) if col else adapter.lora_B.detach().clone(),
            "W": gather(base.weight, 0 if col else 1),
        }
        meta = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
        path = f"{directory}-{case.mode}"
        if dist.get_rank() == 0:
            import os

            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(adapter.sharded_state_dict(metadata=meta), path)

        runtime.initialize(ParallelLayout(tp=1), seed=5)
        _, base1, adapter1 = build(Case(case.mode), 1, seed=123, adapter_seed=0)
        meta = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
        state = dist_checkpointing.load(adapter1.sharded_state_dict(metadata=meta), path)
        missing, unexpected = adapter1.load_state_dict(state, strict=False)
        assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected
        assert torch.equal(adapter1.lora_A, saved["A"])
        assert torch.equal(adapter1.lora_B, saved["B"])
        assert torch.equal(base1.weight, saved["W"])
