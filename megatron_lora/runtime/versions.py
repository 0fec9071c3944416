"""Every difference between the megatron-core releases this package supports (0.16.1 - 0.19.x).

Nothing outside this module (and the CPU compatibility layer, which adapts megatron's CUDA
assumptions) asks which release is installed. Each difference is detected from the installed
code itself (attributes, signatures, what a checkpoint holds), never from the version string,
which is kept only for messages. The table below is the map; each entry names the release that
introduced the change and the megatron-core call site.

| difference | since | megatron-core call site | handled by |
|---|---|---|---|
| layer specs hold `functools.partial(Module, submodules=...)` where earlier releases held `ModuleSpec(module=..., submodules=...)` | 0.19.0 | `models/gpt/gpt_layer_specs.py` (`get_gpt_layer_local_spec`, MoE submodules) | `spec_submodules`, `spec_module` |
| `token_dispatcher.all_to_all(..., use_nccl_stream=...)` keyword | 0.18.0 | `transformer/moe/token_dispatcher.py` -> `tensor_parallel/mappings.py:all_to_all` | `cpu_compat` passes keywords through |
| common (non-tensor) checkpoint state stored as a `common_state` ShardedObject inside the torch_dist files, no `common.pt` | 0.19.0 | `dist_checkpointing/serialization.py` (`save`, `load_common_state_dict`) | `safe_load.load_common_state` reads either form |
| `dist_checkpointing.load` reads the common state itself through torch's plain `FileSystemReader` (no `common_strategy`) | 0.19.0 | `dist_checkpointing/serialization.py:load_common_state_dict` | `safe_load.dist_load` checks every file first |
| `materialize_only_last_token_logits` moved from the inference context into its `InferenceConfig` (`context.config`) | 0.19.0 | `inference/contexts/base_context.py`, `models/gpt/gpt_model.py:_postprocess` | `static_kv_cache` |
| the grad norm filters a replicated expert parameter's duplicates over the expert-TP group (`expert_tp_group`); before, over the dense TP group, so at expert-TP != TP a TP rank left its replicated expert-adapter factors out of the norm (and clipped by another factor) | 0.19.0 | `optimizer/optimizer.py:get_main_grads_for_grad_norm`, `tensor_parallel/layers.py:param_is_not_tensor_parallel_duplicate` | `filter_expert_duplicates_over_expert_tp` |
| legacy `GroupedMLP` (grouped_gemm package) removed; `moe_grouped_gemm=True` means TE's `TEGroupedMLP` | 0.17.0 | `transformer/moe/experts.py` | not used: SequentialMLP only |
| multi-latent attention resolves its q/kv projections and latent norms through `QKNormConfigResolver` (norms only with `qk_layernorm`; without `q_lora_rank` a norm fused into `linear_q_proj`, which the local backend lacks); before, it built the spec's modules | 0.19.0 | `transformer/multi_latent_attention.py:MLASelfAttention._resolve_qk_norm_config`, `transformer/mla_qk_norm_config.py` | `models/mla.py:LocalMLASelfAttention._resolve_qk_norm_config` returns the spec's modules |
| an optimizer's gradients for the norm: `get_main_grads_for_grad_norm()`; renamed `get_grads_for_grad_norm(grad_norm_group=None)`, which leaves out parameters tagged with a separate grad-norm group (`grad_norm_group`, e.g. multi-token prediction's, clipped by their own norm) | 0.19.0 | `optimizer/optimizer.py:MegatronOptimizer` | `grads_for_norm`, `separate_grad_norm_groups` |
| `OptimizerConfig.grad_norm_skip_threshold`: ChainedOptimizer.step skips the update when the norm exceeds it (default inf: never) | 0.19.0 | `optimizer/optimizer.py:ChainedOptimizer.step` | `grad_norm_skip_threshold` |
| without Transformer Engine, `extensions/transformer_engine.py` still imports (TE stood in by a `MagicMock`), so multi-latent attention sets `HAVE_TE = True` with `TELinear` a mock instance and `isinstance(self.linear_proj, TELinear)` raises TypeError at construction; 0.19 fails that import and sets `HAVE_TE = False` | 0.16.x | `transformer/multi_latent_attention.py` lines 54-65, 183-186 | `mla_without_transformer_engine` |
"""

from __future__ import annotations

import functools
from typing import Any

import megatron.core

MCORE_VERSION: str = getattr(megatron.core, "__version__", "unknown")


def spec_module(spec: Any) -> Any:
    """The module class a layer spec builds: `ModuleSpec.module` (<= 0.18) or the class wrapped
    by a `functools.partial` (0.19)."""
    if isinstance(spec, functools.partial):
        return spec.func
    return getattr(spec, "module", spec)


def spec_submodules(spec: Any) -> Any:
    """The `submodules` a layer spec passes to its module, whichever form the spec has."""
    if isinstance(spec, functools.partial):
        return spec.keywords.get("submodules")
    return getattr(spec, "submodules", None)


def spec_replace(spec: Any, *, module: Any = None, submodules: Any = None) -> Any:
    """A copy of a layer spec (either form) that builds `module` and/or passes `submodules`
    (None: keep the spec's). The original is not modified (megatron's specs may be shared)."""
    import dataclasses

    if isinstance(spec, functools.partial):
        keywords = dict(spec.keywords)
        if submodules is not None:
            keywords["submodules"] = submodules
        return functools.partial(module or spec.func, *spec.args, **keywords)
    changes = {}
    if module is not None:
        changes["module"] = module
    if submodules is not None:
        changes["submodules"] = submodules
    return dataclasses.replace(spec, **changes)


def mla_without_transformer_engine() -> None:
    """Let megatron's multi-latent attention build without Transformer Engine: where its module
    found only megatron's mock stand-ins for TE's classes (0.16.x; not types), mark TE absent,
    as 0.19 does itself. With TE installed, or on 0.19, nothing changes."""
    from megatron.core.transformer import multi_latent_attention as mla

    if mla.HAVE_TE and not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False


def static_kv_cache(max_batch_size: int, max_sequence_length: int) -> Any:
    """megatron-core's StaticInferenceContext (the per-layer KV cache that SelfAttention fills
    when the model is called with `inference_context=`) for up to `max_batch_size` sequences of
    `max_sequence_length` tokens, set to return the logits of every position of a call (megatron's
    default keeps only the last one, which under sequence parallelism is this rank's last local
    token, and which a padded chunk would make the padding's)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    context = StaticInferenceContext(max_batch_size, max_sequence_length)
    inference_config = getattr(context, "config", None)
    if inference_config is not None and hasattr(inference_config,
                                                "materialize_only_last_token_logits"):
        inference_config.materialize_only_last_token_logits = False  # 0.19
    context.materialize_only_last_token_logits = False  # <= 0.18 reads it here
    return context


def filter_expert_duplicates_over_expert_tp(optimizer: Any) -> None:
    """Make the grad norm of megatron's optimizer count each expert parameter once per
    expert-TP shard, on every release.

    A replicated parameter (`tensor_model_parallel` False, e.g. an expert adapter's factor that
    every expert-TP rank holds whole) is counted only on rank 0 of the optimizer's `tp_group`.
    Releases whose duplicate filter takes no `expert_tp_group` use the dense TP group for the
    expert sub-optimizer too: with expert-TP 1 under TP 2, a dense-TP rank 1 then drops its
    experts' replicated factors, so the ranks compute different norms and clip differently.
    There the expert sub-optimizer's `tp_group` becomes the expert-TP group (megatron's own
    expert weights are all `tensor_model_parallel`, so only such factors are affected)."""
    import inspect

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    if "expert_tp_group" in inspect.signature(param_is_not_tensor_parallel_duplicate).parameters:
        return  # 0.19+: megatron filters expert parameters over the expert-TP group itself
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        groups = getattr(getattr(sub, "optimizer", None), "param_groups", [])
        if groups and all(g.get("is_expert_parallel", False) for g in groups):
            sub.tp_group = parallel_state.get_expert_tensor_parallel_group()


def grads_for_norm(optimizer: Any) -> list:
    """The gradients a megatron (sub-)optimizer counts in its gradient norm, filtered as megatron
    filters them (no shared parameter twice, no tensor-parallel duplicate): its tensors, on the
    device, whichever release names the method."""
    if hasattr(optimizer, "get_grads_for_grad_norm"):  # 0.19+
        return optimizer.get_grads_for_grad_norm()
    return optimizer.get_main_grads_for_grad_norm()


def separate_grad_norm_groups(optimizer: Any) -> bool:
    """Whether a parameter of this (sub-)optimizer is tagged with a gradient-norm group of its
    own (0.19's `grad_norm_group` attribute), which megatron clips by that group's norm; never
    before 0.19."""
    try:
        from megatron.core.optimizer.optimizer import GRAD_NORM_GROUP_ATTR
    except ImportError:  # <= 0.18: no such groups
        return False
    return any(getattr(p, GRAD_NORM_GROUP_ATTR, None) is not None
               for p in optimizer.get_parameters())


def grad_norm_skip_threshold(config: Any) -> float:
    """The norm above which 0.19's ChainedOptimizer skips an update (inf: never; no such setting
    before 0.19)."""
    return float(getattr(config, "grad_norm_skip_threshold", float("inf")))
