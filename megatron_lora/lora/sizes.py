"""The problems of a LoraConfig for a model of given sizes, found without the model.

Pure functions of the config and a TransformerConfig (or any object with its size fields), so
every rank finds the same problems before anything is built or communicated: targets the model
does not have, ranks larger than a targeted weight allows, rank or alpha patterns that match no
adapter, and ranks that vary within a kind (checkpoints stack a kind over layers and experts).
`lora.model` uses them on a built model; `model_problems` on a `families.ModelInfo` before one.
"""

from __future__ import annotations

import re
from typing import List, Tuple

from megatron_lora.families.shape import MLA_INPUTS, MlaShape, moe_layer_pattern
from megatron_lora.lora.targets import KINDS


def model_kinds(config) -> Tuple[str, ...]:
    """The target kinds a megatron GPT model with TransformerConfig `config` has (any stage)."""
    kinds = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "embedding", "output_layer"]
    if config.num_moe_experts:
        kinds.insert(4, "router")
    return tuple(k for k in KINDS if k in kinds)


def mla_projections(config) -> List[Tuple[str, Tuple[int, str], Tuple[int, str]]]:
    """(attribute, (in_features, what), (out_features, what)) of each input projection of a
    multi-latent attention layer (the linear_qkv kind there, one adapter stack each); [] for a
    model without MLA (config.multi_latent_attention)."""
    if not getattr(config, "multi_latent_attention", False):
        return []
    mla = MlaShape(q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
                   qk_head_dim=config.qk_head_dim, qk_pos_emb_head_dim=config.qk_pos_emb_head_dim,
                   v_head_dim=config.v_head_dim)
    shapes = mla.linear_shapes(config.hidden_size, config.num_attention_heads)
    return [(name, (n_in, _MLA_WHAT[name][0]), (n_out, _MLA_WHAT[name][1]))
            for name, (n_in, n_out) in shapes.items() if name in MLA_INPUTS]


# what the sizes of each MLA input projection (in, out) come from, for messages
_MLA_WHAT = {
    "linear_q_proj": ("hidden size", "heads x (nope + rope) head dim"),
    "linear_q_down_proj": ("hidden size", "q_lora_rank"),
    "linear_q_up_proj": ("q_lora_rank", "heads x (nope + rope) head dim"),
    "linear_kv_down_proj": ("hidden size", "kv_lora_rank + rope head dim"),
    "linear_kv_up_proj": ("kv_lora_rank", "heads x (nope + value) head dim"),
}


def _features(config, kind: str, vocab_size: int) -> Tuple[Tuple[int, str], Tuple[int, str]]:
    """((in_features, what), (out_features, what)) of a target kind's global weight, from the
    config alone; `what` names the model sizes each comes from (for messages)."""
    h = config.hidden_size
    heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
    ffn = config.moe_ffn_hidden_size if config.num_moe_experts else config.ffn_hidden_size
    fc1 = ffn * (2 if config.gated_linear_unit else 1)
    hid, inter = (h, "hidden size"), (ffn, "ffn hidden size")
    if kind == "linear_proj" and getattr(config, "multi_latent_attention", False):
        return (heads * config.v_head_dim, "heads x value head dim"), hid
    return {
        "linear_qkv": (hid, ((heads + 2 * groups) * d, "(heads + 2 kv heads) x head dim")),
        "linear_proj": ((heads * d, "heads x head dim"), hid),
        "linear_fc1": (hid, (fc1, "2 x ffn hidden size" if config.gated_linear_unit
                             else "ffn hidden size")),
        "linear_fc2": (inter, hid),
        "router": (hid, (config.num_moe_experts or 0, "number of experts")),
        "embedding": ((vocab_size, "vocabulary"), hid),
        "output_layer": (hid, (vocab_size, "vocabulary")),
    }[kind]


def config_problems(config, sizes, vocab_size: int, *, rank_name: str = "LoraConfig.r",
                    pattern_name: str = "rank_pattern",
                    targets_name: str = "target_modules",
                    alpha_pattern_name: str = "alpha_pattern") -> List[str]:
    """Every problem of `config` for a model of these sizes, without the model (pure, so every
    rank finds the same ones before building anything or communicating).

    sizes: a TransformerConfig, or any object with its size fields (num_layers, hidden_size,
        num_attention_heads, num_query_groups, kv_channels, ffn_hidden_size,
        moe_ffn_hidden_size, num_moe_experts, gated_linear_unit; moe_layer_freq if some layers
        are dense, ffn_hidden_size then being their MLP's size).
    rank_name / pattern_name / targets_name / alpha_pattern_name: how the messages call r,
        rank_pattern, target_modules and alpha_pattern (a CLI passes its flags, e.g.
        "--lora-rank").

    A rank_pattern or alpha_pattern key that matches no targeted adapter's global name is a
    problem (it would otherwise be ignored silently).
    """
    available = model_kinds(sizes)
    missing = [k for k in config.target_modules if k not in available]
    if missing:
        return [f"LoRA targets {missing} ({targets_name}) do not exist in this model; its targets "
                f"are {', '.join(available)}"]
    problems = _unmatched_pattern_problems(config, sizes, pattern_name, alpha_pattern_name,
                                           targets_name)
    for kind, names, ((n_in, what_in), (n_out, what_out)) in _stacks(sizes, config.target_modules,
                                                                     vocab_size):
        limit = min(n_in, n_out)
        ranks = {config.adapter_config(n).rank for n in names}
        too_big = sorted(r for r in ranks if r > limit)
        if too_big:
            source = rank_name if too_big[-1] == config.r else f"{rank_name} or {pattern_name}"
            problems.append(
                f"LoRA rank {too_big[-1]} ({source}) exceeds min(in_features, out_features) = "
                f"{limit} of {kind} (in_features {n_in} = {what_in}, out_features {n_out} = "
                f"{what_out}); use a rank <= {limit} (for {kind} alone: {pattern_name} "
                f"{kind}=R) or drop {kind} from {targets_name}")
    return problems + _rank_consistency_problems(config, sizes, pattern_name)


def _unmatched_pattern_problems(config, sizes, pattern_name: str,
                                alpha_pattern_name: str, targets_name: str) -> List[str]:
    names = [n for kind in config.target_modules for n in _global_names(kind, sizes)]
    problems = []
    for what, patterns in ((pattern_name, config.rank_pattern),
                           (alpha_pattern_name, config.alpha_pattern)):
        for pattern in patterns:
            if not any(re.search(pattern, n) for n in names):
                problems.append(
                    f"{what} {pattern!r} matches no adapter of this model (it is searched in the "
                    f"global names of the {targets_name} adapters, e.g. {names[0]!r} ... "
                    f"{names[-1]!r})")
    return problems


def _moe_layers(tconf) -> list:
    """Per layer 1 (MoE) or 0 (dense MLP), as megatron builds them from moe_layer_freq."""
    return moe_layer_pattern(getattr(tconf, "moe_layer_freq", 1), tconf.num_layers,
                             tconf.num_moe_experts)


def _dense_names(kind: str, tconf) -> List[str]:
    """The dense layers' MLP adapters of a model with experts (moe_layer_freq with 0s)."""
    if kind not in ("linear_fc1", "linear_fc2") or not tconf.num_moe_experts:
        return []
    return [f"decoder.layers.{l}.mlp.{kind}" for l, moe in enumerate(_moe_layers(tconf))
            if not moe]


def _shared_ffn(tconf) -> int:
    """The shared expert's FFN size (megatron's moe_shared_expert_intermediate_size), or 0."""
    return (getattr(tconf, "moe_shared_expert_intermediate_size", None) or 0) \
        if tconf.num_moe_experts else 0


def _shared_names(kind: str, tconf) -> List[str]:
    if kind not in ("linear_fc1", "linear_fc2") or not _shared_ffn(tconf):
        return []
    return [f"decoder.layers.{l}.mlp.shared_experts.{kind}"
            for l, moe in enumerate(_moe_layers(tconf)) if moe]


def _stacks(tconf, kinds, vocab_size: int):
    """(kind, global names, features) of every group of adapters checkpointed as one stacked
    tensor: a kind's routed (or dense) adapters, the shared experts' of fc1 / fc2, and the dense
    layers' MLP (between MoE layers) of fc1 / fc2."""
    for kind in kinds:
        mla = mla_projections(tconf) if kind == "linear_qkv" else []
        for attr, n_in, n_out in mla:
            yield kind, _mla_names(attr, tconf), (n_in, n_out)
        if not mla:
            yield kind, _global_names(kind, tconf, shared=False), _features(tconf, kind,
                                                                            vocab_size)
        dense = _dense_names(kind, tconf)
        if dense:
            fd = tconf.ffn_hidden_size
            hid, inter = (tconf.hidden_size, "hidden size"), (fd, "dense MLP ffn size")
            fc1 = (2 * fd if tconf.gated_linear_unit else fd, "dense MLP fc1 rows")
            yield kind, dense, ((hid, fc1) if kind == "linear_fc1" else (inter, hid))
        shared = _shared_names(kind, tconf)
        if shared:
            fs = _shared_ffn(tconf)
            hid, inter = (tconf.hidden_size, "hidden size"), (fs, "shared expert ffn size")
            fc1 = (2 * fs if tconf.gated_linear_unit else fs, "shared expert fc1 rows")
            yield kind, shared, ((hid, fc1) if kind == "linear_fc1" else (inter, hid))


def _global_names(kind: str, tconf, shared: bool = True) -> List[str]:
    """Global adapter names of `kind` (with the shared experts' and the dense layers' MLP unless
    shared=False)."""
    if shared:
        return (_global_names(kind, tconf, shared=False) + _shared_names(kind, tconf)
                + _dense_names(kind, tconf))
    layers = range(tconf.num_layers)
    if kind in ("embedding", "output_layer"):
        return [kind]
    if kind == "router":
        return [f"decoder.layers.{l}.mlp.router" for l, moe in enumerate(_moe_layers(tconf))
                if moe]
    if kind == "linear_qkv" and mla_projections(tconf):
        return [n for attr, _, _ in mla_projections(tconf) for n in _mla_names(attr, tconf)]
    if kind in ("linear_qkv", "linear_proj"):
        return [f"decoder.layers.{l}.self_attention.{kind}" for l in layers]
    if tconf.num_moe_experts:
        return [f"decoder.layers.{l}.mlp.experts.{e}.{kind}" for l, moe in
                enumerate(_moe_layers(tconf)) if moe for e in range(tconf.num_moe_experts)]
    return [f"decoder.layers.{l}.mlp.{kind}" for l in layers]


def _mla_names(attr: str, tconf) -> List[str]:
    return [f"decoder.layers.{l}.self_attention.{attr}" for l in range(tconf.num_layers)]


def _rank_consistency_problems(config, tconf,
                               pattern_name: str = "rank_pattern") -> List[str]:
    """Adapters of one kind are checkpointed as one tensor stacked over layers (and experts), as
    megatron stores their base weights, so a rank_pattern may vary the rank between kinds but not
    between layers or experts of one kind."""
    problems = []
    for kind in config.target_modules:
        mla = [(f"{attr} ", _mla_names(attr, tconf))
               for attr, _, _ in (mla_projections(tconf) if kind == "linear_qkv" else [])]
        groups = (mla or [("", _global_names(kind, tconf, shared=False))]) + [
            ("shared-expert ", _shared_names(kind, tconf)),
            ("dense-MLP ", _dense_names(kind, tconf))]
        for what, names in groups:
            ranks = {config.adapter_config(n).rank for n in names}
            if len(ranks) > 1:
                problems.append(
                    f"{pattern_name} gives the {what}{kind} adapters different ranks "
                    f"{sorted(ranks)} across layers or experts; adapters of one kind share one "
                    f"rank (they are checkpointed stacked over layers and experts)")
    return problems


def model_problems(config, info, **names) -> List[str]:
    """Every problem of LoraConfig `config` for the model `info` (a families.ModelInfo), from its
    sizes alone; names: rank_name / targets_name / ... for the messages (a CLI passes its flags)."""
    return config_problems(config, info.lora_sizes(), info.shape.vocab_size, **names)
