"""Checkpoints and bad input for MoE / router / embedding adapters.

- A base checkpoint written before wrapping loads into the wrapped layer (the base's ShardedTensor
  keys and dict keys are unchanged by wrapping), across TP sizes.
- Expert and router adapters saved at one EP x expert-TP layout load at another, keyed by global
  expert index (megatron's expert axis), gated fc1 B with its [gate; up] global layout.
- Bad input (rank or expert count that does not fit, wrong targets, a router that does not exist,
  a token split that does not fit) raises a clear error, with no collective issued and no module
  replaced.
"""

import os

import pytest
import torch
import torch.distributed as dist

from megatron_lora.runtime import ParallelLayout
from tests.harness import multirank


def _save(state, path):
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, path)


def _load(module, path, skip_prefix=None):
    """Load `path` into `module`; entries whose dict key starts with skip_prefix are not in the
    checkpoint (a base checkpoint has no adapter factors) and keep their values."""
    from megatron.core import dist_checkpointing

    request = {k: v for k, v in module.sharded_state_dict().items()
               if skip_prefix is None or not k.startswith(skip_prefix)}
    state = dist_checkpointing.load(request, path)
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")
               and not (skip_prefix and k.startswith(skip_prefix))]
    assert not missing and not unexpected, (missing, unexpected)


def _perturb(t: torch.Tensor) -> torch.Tensor:  # "trained" factors, a function of the init
    return t * 1.5 + 0.25


@multirank(world_size=2, timeout=600)
def test_checkpoints_reshard_and_keep_base_keys(tmp_path):
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_lora import runtime
    from megatron_lora.lora import AdapterConfig, LoraAdapter
    from megatron_lora.lora.factors import init_global_factors, shard_like_base as _shard
    from tests.lora import _moe_support as M
    from tests.lora._support import gather

    # 1. base saved unwrapped at TP2 (gated fc1: stride 2), loaded into a wrapped layer at TP1.
    def fc1(tp):
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4,
                                   tensor_model_parallel_size=tp, use_cpu_initialization=True)
        torch.manual_seed(3 if tp == 2 else 99)
        return ColumnParallelLinear(16, 24, config=config, bias=False, stride=2,
                                    init_method=lambda w: torch.nn.init.normal_(w))

    runtime.initialize(ParallelLayout(tp=2), seed=5)
    plain = fc1(2)
    saved = gather(plain.weight, 0)
    _save(plain.sharded_state_dict(metadata={"dp_cp_group": _dp()}), str(tmp_path / "base"))
    runtime.initialize(ParallelLayout(tp=1), seed=5)
    wrapped = LoraAdapter(fc1(1), AdapterConfig(rank=2, alpha=4), seed=1)
    base_keys = {k: v.key for k, v in fc1(1).sharded_state_dict(
        metadata={"dp_cp_group": _dp()}).items()}
    wrapped_keys = {k: v.key for k, v in wrapped.sharded_state_dict().items()
                    if not k.startswith("lora_")}
    assert wrapped_keys == base_keys, (wrapped_keys, base_keys)
    _load(wrapped, str(tmp_path / "base"), skip_prefix="lora_")
    assert torch.equal(wrapped.base_layer.weight, saved)

    # 2. expert + router adapters: save at EP2 x ETP1, load at EP1 x ETP2 (and the reverse).
    cfg = AdapterConfig(rank=M.RANK, alpha=M.ALPHA, init_lora_weights=False)
    weights = M.global_weights()
    for save_at, load_at, name in ((ParallelLayout(ep=2), ParallelLayout(etp=2), "a"),
                                   (ParallelLayout(etp=2), ParallelLayout(ep=2), "b")):
        runtime.initialize(save_at, seed=5)
        _, layer, adapters, router = M.build_layer(save_at, "alltoall", weights, cfg)
        with torch.no_grad():
            for p in [router.lora_A, router.lora_B] + [q for ad in adapters
                                                       for q in (ad.lora_A, ad.lora_B)]:
                p.copy_(_perturb(p))
        _save(layer.sharded_state_dict(), str(tmp_path / name))

        runtime.initialize(load_at, seed=5)
        _, layer, adapters, router = M.build_layer(load_at, "alltoall", weights, cfg)
        _load(layer, str(tmp_path / name))
        t, k = layer.experts.tp_group.size(), layer.experts.tp_group.rank()
        assert len(adapters) == 2 * layer.experts.num_local_experts > 0  # no rank checks nothing
        ar, br = init_global_factors(cfg, M.H, M.E, M.seed_for("router"))
        assert torch.equal(router.lora_A, _perturb(ar)) and torch.equal(router.lora_B, _perturb(br))
        for ad in adapters:
            fc1_ = ad.global_name.endswith("linear_fc1")
            i, o = (M.H, 2 * M.FFN) if fc1_ else (M.FFN, M.H)
            a, b = init_global_factors(cfg, i, o, M.seed_for(ad.global_name))
            a, b = _perturb(a), _perturb(b)
            want_a = a if fc1_ else _shard(a, 1, t, k)
            want_b = _shard(b, 0, t, k, 2) if fc1_ else b
            assert torch.equal(ad.lora_A, want_a), ad.global_name
            assert torch.equal(ad.lora_B, want_b), ad.global_name
        # the base expert weights still come back (MLP's gated-fc1 sharding found its key)
        e0 = layer.experts.ep_group.rank() * layer.experts.num_local_experts
        w = layer.experts.local_experts[0].linear_fc1.weight
        assert torch.equal(w, _shard(weights["fc1"][e0], 0, t, k, 2))


def _dp():
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


@pytest.mark.parametrize("layout", [ParallelLayout(ep=2)], ids=["EP2"])
@multirank(world_size=2, timeout=300)
def test_bad_input_is_rejected_before_any_collective(layout):
    from megatron_lora.lora import AdapterConfig, UnsupportedBaseLayerError
    from megatron_lora.lora.accounting import record_collectives
    from megatron_lora.lora.embedding import wrap_embedding, wrap_output_layer
    from megatron_lora.lora.experts import wrap_experts
    from megatron_lora.lora.expert_lora import ExpertLora
    from megatron_lora.lora.router import wrap_router
    from tests.lora import _moe_support as M

    ok = AdapterConfig(rank=4, alpha=8)
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_lora.models.specs import local_layer_spec
    from megatron_lora.runtime.versions import spec_submodules

    fresh = MoELayer(M.layer_config(layout, "allgather"),
                     submodules=spec_submodules(local_layer_spec(M.E).submodules.mlp))
    experts = fresh.experts
    prefix = "decoder.layers.0.mlp.experts"

    def stacked(cfg):  # the stacked fc1 adapters of the local experts, nothing wrapped
        bases = [mlp.linear_fc1 for mlp in experts.local_experts]
        names = [f"{prefix}.{e}.linear_fc1" for e in range(len(bases))]
        return ExpertLora("linear_fc1", bases, [cfg] * len(bases), [1] * len(bases), names=names,
                          first_expert=0, freeze_base=False)

    def only_last_fc2_too_big(name):  # a rank pattern that fails on the last adapter
        return AdapterConfig(rank=10_000 if name.endswith("7.linear_fc2") else 4, alpha=8)

    bad = [
        (lambda: wrap_experts(experts, AdapterConfig(rank=49, alpha=8), prefix=prefix,
                              seed_for=M.seed_for),
         ValueError, r"LoRA rank 49 for decoder\.layers\.0\.mlp\.experts\.[04]\.linear_fc1 exceeds "
         r"min\(in_features, out_features\) = 32"),
        (lambda: wrap_experts(experts, only_last_fc2_too_big, prefix=prefix,
                              seed_for=M.seed_for), ValueError, r"experts\.7\.linear_fc2"),
        (lambda: wrap_experts(experts, ok, prefix=prefix, seed_for=M.seed_for,
                              targets=("linear_qkv",)), ValueError, r"targets must be"),
        (lambda: wrap_experts(fresh.router, ok, prefix=prefix, seed_for=M.seed_for),
         UnsupportedBaseLayerError, r"needs a megatron-core SequentialMLP"),
        (lambda: wrap_experts(experts, AdapterConfig(rank=4, alpha=8, dropout=0.1),
                              prefix=prefix, seed_for=M.seed_for), ValueError,
         r"expert LoRA dropout > 0 needs moe_layer="),
        (lambda: wrap_experts(experts, ok, prefix=prefix, seed_for=M.seed_for, moe_layer=experts),
         ValueError, r"moe_layer must be the MoELayer whose `experts` is experts_module"),
        (lambda: _wrap_with_local_count(experts, 3, ok, prefix=prefix, seed_for=M.seed_for),
         ValueError, r"expert count does not fit the layout: num_local_experts=3 x EP size 2"),
        (lambda: wrap_router(None, ok, seed=1), UnsupportedBaseLayerError,
         r"router LoRA needs a megatron-core MoE router .* this layer has no router"),
        (lambda: wrap_router(fresh.router, AdapterConfig(rank=9, alpha=8), seed=1), ValueError,
         r"rank=9 is larger than min\(hidden, num_experts\)"),
        (lambda: wrap_embedding(fresh.router, ok, seed=1), UnsupportedBaseLayerError,
         r"VocabParallelEmbedding"),
        (lambda: wrap_output_layer(fresh.router, ok, seed=1), UnsupportedBaseLayerError,
         r"column-parallel"),
        (lambda: wrap_experts(experts, lambda n: AdapterConfig(
            rank=4, alpha=8, dropout=0.1 if "3." in n else 0.0), prefix=prefix,
            seed_for=M.seed_for, moe_layer=fresh), ValueError,
         r"every expert's linear_fc1 adapter must have the same dropout"),
        (lambda: stacked(ok).grouped(torch.zeros(7, M.H), [2, 2, 1, 1, 1]), ValueError,
         r"tokens_per_expert \[2, 2, 1, 1, 1\] \(from local expert 0\) does not fit 4 local"),
        (lambda: stacked(AdapterConfig(rank=4, alpha=8, dropout=0.1)).grouped(
            torch.zeros(5, M.H), [2, 3, 0, 0]),
         ValueError, r"dropout 0.1 in training needs token_ids"),
    ]
    with record_collectives() as calls:
        for make, error, pattern in bad:
            with pytest.raises(error, match=pattern):
                make()
    assert calls == [], f"collectives were issued while rejecting bad input: {calls}"
    from megatron_lora.lora.experts import ExpertSlot

    assert not any(isinstance(m, (ExpertSlot, ExpertLora)) for m in experts.modules()), \
        "partially wrapped"


def _wrap_with_local_count(experts, count, *args, **kwargs):
    """wrap_experts on an experts module that claims `count` local experts."""
    from megatron_lora.lora.experts import wrap_experts

    experts.num_local_experts, original = count, experts.num_local_experts
    try:
        return wrap_experts(experts, *args, **kwargs)
    finally:
        experts.num_local_experts = original
