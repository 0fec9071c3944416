"""Adapter checkpoint -> Hugging Face PEFT LoRA adapter (per-expert layout), streamed.

    export_peft("runs/lora", "my-adapter", hf_config="Mixtral-8x7B-v0.1")

Reads one adapter's factors at a time from the torch_dist checkpoint (any layout it was saved at;
no model, no torch.distributed, no base weights), splits fused projections losslessly (A copied to
every part, B's rows split: linear_qkv -> q/k/v by megatron's per-query-group layout, linear_fc1
-> w1/w3, padded vocabulary rows dropped) and appends them to `adapter_model.safetensors`. Every
value is copied bit for bit in the checkpoint's dtype. Peak memory: about one adapter's factors
twice (read + split). `adapter_config.json` gets `r` / `lora_alpha` (the experts' values when they
are targeted, else the most common ones), `use_rslora`, `target_modules` and `rank_pattern` /
`alpha_pattern` entries for the modules whose values differ (by module name such as `q_proj`, or
by full path when instances of one module differ). `lora_dropout` is the trained value, or 0 when
the experts or the router are targeted (PEFT's ParamWrapper, which adapts transformers 5's fused
parameters, refuses dropout; dropout does not act at inference): `notes` says so.
DoRA adapters (use_dora) on attention get PEFT's `lora_magnitude_vector` per module (the
magnitude's rows split like B's) and `use_dora: true`; PEFT has no DoRA for Mixtral's experts,
so an expert DoRA adapter is refused with a pointer to the merged export (`export hf --merge`).
Trainable tokens (train --add-special-tokens) become PEFT's `trainable_token_indices`
({"embed_tokens": ids, "lm_head": ids}) with the rows as `...embed_tokens.token_adapter.
trainable_tokens_delta` / `lm_head.token_adapter.trainable_tokens_delta`, and the run's extended
tokenizer (`--save/tokenizer`) is copied into the export folder; transformers + PEFT load it after
`model.resize_token_embeddings(len(tokenizer))` when the ids are past the model's vocab_size.
Prefix tuning (LoraConfig.num_virtual_tokens) becomes PEFT's PREFIX_TUNING: `prompt_embeddings`
[n, L * 2 * td] (AdapterCheckpoint.prefix_table; with prefix_projection the projected table, as
PEFT's own save holds it, computed in fp32 and written in the checkpoint dtype) and the
adapter_config.json PEFT writes (peft_config.prefix_config_dict).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from typing import Dict, List, Optional, Tuple

import torch

from megatron_lora.convert.atomic import atomic_directory
from megatron_lora.convert.outputs import prepare_output_dir
from megatron_lora.convert.safetensors_write import StreamingSafetensorsWriter
from megatron_lora.export import peft_fused
from megatron_lora.export.adapter_ckpt import AdapterCheckpoint
from megatron_lora.export.peft_config import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    adapter_config_dict,
    inference_dropout,
    prefix_config_dict,
)
from megatron_lora.convert.errors import ConversionError
from megatron_lora.export.peft_fused import refuse_fused_experts
from megatron_lora.export.table import (
    module_of,
    peft_keys,
    peft_magnitude_key,
    short_name,
    sites,
    split_rows,
)
from megatron_lora.families import read_hf_config

# The table's kinds of a dense layer's MLP (between MoE layers).
DENSE = ("dense_fc1", "dense_fc2")
# ... and of a shared expert (beside the routed ones).
SHARED = ("shared_fc1", "shared_fc2")


def _patterns(values: Dict[str, Tuple[int, float]], default: Tuple[int, float], order):
    """rank_pattern, alpha_pattern (PEFT syntax) for modules whose (r, alpha) differ from default;
    order: the family's short module names in model order (HFNames.peft_order)."""
    by_short: Dict[str, set] = {}
    for module, v in values.items():
        by_short.setdefault(short_name(module), set()).add(v)
    rank_p, alpha_p = {}, {}
    for short in sorted(by_short, key=order.index):
        vals = by_short[short]
        if len(vals) == 1:
            (r, alpha), = vals
            keys = {short: (r, alpha)}
        else:  # instances differ: one entry per module path
            keys = {re.escape(m): v for m, v in values.items() if short_name(m) == short}
        for key, (r, alpha) in keys.items():
            if r != default[0]:
                rank_p[key] = r
            if alpha != default[1]:
                alpha_p[key] = alpha
    return rank_p, alpha_p


def _target_name(names, module: str, dense: bool = False) -> str:
    """PEFT's target_modules entry of an HF module: its short name, with the shared expert's
    parent (`shared_expert.gate_proj`) so that it names the shared expert alone, and a dense
    layer's MLP with its parent (`mlp.gate_proj`: not the shared expert's)."""
    shared = names.shared_expert.rstrip(".").rsplit(".", 1)[-1]
    parts = module.split(".")
    if dense:
        return names.dense_mlp + parts[-1]
    if len(parts) > 1 and parts[-2] == shared:
        return f"{shared}.{parts[-1]}"
    return parts[-1]


def _rank(order, target: str) -> tuple:
    """Sort key: the family's module order; shared-expert names after the routed ones."""
    return (target.count("."), order.index(target.rsplit(".", 1)[-1]))


def _default(values: Dict[str, Tuple[int, float]], expert_gate: str) -> Tuple[int, float]:
    # transformers 5 fuses w1/w3 into gate_up_proj with PEFT's global r and lora_alpha (it ignores
    # patterns there), so the experts' values are the defaults when they are targeted.
    experts = [v for m, v in values.items() if short_name(m) == expert_gate]
    if experts:
        return Counter(experts).most_common(1)[0][0]
    return Counter(values.values()).most_common(1)[0][0]


def export_peft(adapter: str, save: str, *, hf_config: str, overwrite: bool = False,
                base_model: str = None, notes: Optional[List[str]] = None,
                allow_other_base: bool = False) -> dict:
    """Write `save/adapter_model.safetensors` and `save/adapter_config.json`; returns the config.

    adapter: adapter checkpoint (iteration folder, or a run folder with a tracker).
    hf_config: the base model's config.json (or its folder; nothing else is read).
    notes: when given, a list that gets one line per setting changed for inference (and why).
    allow_other_base: apply an adapter recorded as trained on another base (lora/adapter_base)."""
    prepare_output_dir(save, overwrite=overwrite,
                       inputs={"--adapter": adapter, "--load-hf": hf_config})
    info = read_hf_config(hf_config)
    refuse_fused_experts(info)
    ckpt = AdapterCheckpoint(adapter, info, allow_other_base)
    if ckpt.config.num_virtual_tokens:
        return _export_prefix(ckpt, info, save, overwrite, base_model, notes)
    dora = ckpt.config.use_dora
    experts = [k.name for k in ckpt.kinds() if k.target_kind in ("linear_fc1", "linear_fc2")]
    fused = info.family.peft_fused_experts
    kinds = {k.name for k in ckpt.kinds()}
    if dora and experts:
        raise ConversionError(
            f"{adapter}: a DoRA adapter (trained with --lora-use-dora) on the experts "
            f"({', '.join(experts)}) has no PEFT format: PEFT supports DoRA on linear modules, not "
            f"on routed experts. Export the merged model instead: megatron-lora export hf "
            f"--merge --load BASE --adapter {adapter} --save OUT (or train DoRA on linear_qkv / "
            f"linear_proj only to get a PEFT adapter)")
    entries: List[Tuple[str, Tuple[int, ...], object]] = []
    values: Dict[str, Tuple[int, float]] = {}
    plan = []
    for kind in ckpt.kinds():
        embedding = kind.name == "embedding"
        for site in sites(info, kind):
            r, alpha, _ = ckpt.scaling(site)
            plan.append(site)
            if fused and kind.name in peft_fused.ROUTED:  # one [E r, in] / [out, E r] pair a layer
                values.update({m: (r, alpha) for m in site.modules()})
                if site.index[1] == 0:
                    a_key, b_key = peft_fused.keys(info.family.names, site.index[0], kind.name,
                                                   kinds)
                    a_shape, b_shape = peft_fused.shapes(info, kind.name, r)
                    entries += [(a_key, a_shape, ckpt.dtype), (b_key, b_shape, ckpt.dtype)]
                continue
            for part in site.parts:
                for name, (rows, cols) in part.source.hf_shapes().items():
                    module = module_of(name)
                    values[module] = (r, alpha)
                    a_key, b_key = peft_keys(module, embedding)
                    a_shape, b_shape = ((r, rows), (cols, r)) if embedding else ((r, cols), (rows, r))
                    entries += [(a_key, a_shape, ckpt.dtype), (b_key, b_shape, ckpt.dtype)]
                    if dora:
                        entries.append((peft_magnitude_key(module), (rows,), ckpt.dtype))
    tokens = list(ckpt.config.trainable_token_indices)
    for key in TOKEN_TENSORS.values():
        if tokens:
            entries.append((key, (len(tokens), info.shape.hidden_size), ckpt.dtype))
    names = info.family.names
    gate = names.kind_modules()["linear_fc1"][0]
    use_rslora = ckpt.config.use_rslora
    if use_rslora and not fused and any(short_name(m) == gate for m in values):
        # transformers 5 fuses the experts' gate and up projections into gate_up_proj, which
        # PEFT adapts with r and lora_alpha doubled: that keeps alpha / r but not rsLoRA's
        # alpha / sqrt(r) (PEFT would scale gate/up by sqrt(2) too much). Plain LoRA with alpha
        # * sqrt(r) gives every module its trained rsLoRA scale.
        values = {m: (r, alpha * math.sqrt(r)) for m, (r, alpha) in values.items()}
        use_rslora = False
        if notes is not None:
            notes.append(f"use_rslora=true written as use_rslora=false with lora_alpha x sqrt(r) "
                         f"in {CONFIG_NAME} (the same scales): PEFT fuses the experts' gate and "
                         f"up adapters doubling r and lora_alpha, which changes an rsLoRA scale")
    default = _default(values, gate)
    order = names.peft_order()
    parameters = []
    dense = {m for s in plan if s.kind.name in DENSE for m in s.modules()}
    shared = {m for s in plan if s.kind.name in SHARED for m in s.modules()}
    if (dense or shared) and not fused:
        # PEFT moves every target_modules entry ending in gate_proj / up_proj / down_proj onto
        # the fused experts, which would drop the dense layers' and the shared expert's
        # adapters: their weights are named as target_parameters instead (lora.ParamWrapper on
        # the nn.Linear weight, the same update and keys), all at the adapter's default (r, alpha).
        if peft_fused.check_uniform(values, sorted(dense | shared),
                                    "dense-layer / shared-expert MLP", adapter) != default:
            raise ConversionError(f"{adapter}: the dense layers' or shared expert's MLP adapters "
                                  f"have another (rank, alpha) than the adapter's default; PEFT "
                                  f"takes them as target_parameters with the global r and "
                                  f"lora_alpha")
        parameters = sorted({(names.dense_mlp if m in dense else names.shared_expert)
                             + short_name(m) + ".weight" for m in dense | shared},
                            key=lambda t: (t.count("."), order.index(t.split(".")[-2])))
    if fused:  # router and routed experts: target_parameters, one (r, alpha) for all experts
        routed = [m for s in plan if s.kind.name in peft_fused.ROUTED for m in s.modules()]
        if routed and peft_fused.check_uniform(values, routed, "routed experts'",
                                               adapter) != default:
            raise ConversionError(f"{adapter}: the routed experts' (rank, alpha) differ from the "
                                  f"adapter's default; PEFT's fused experts take the global r and "
                                  f"lora_alpha")
        parameters = peft_fused.target_parameters(names, kinds)
        wrapped = set(routed) | {m for s in plan if s.kind.name == "router" for m in s.modules()}
    else:
        wrapped = dense | shared
    plain = {m: v for m, v in values.items() if m not in wrapped}
    rank_p, alpha_p = _patterns(plain, default, order)
    shorts = sorted({_target_name(names, m, m in dense) for m in plain},
                    key=lambda t: _rank(order, t))
    dropout, changed = inference_dropout(
        ckpt.config.lora_dropout, shorts + [short_name(m) for m in values if m not in plain],
        names.parameter_modules())
    if notes is not None:
        notes.extend(changed)
        notes.extend(_packed_note(names, values))
    config = adapter_config_dict(
        r=default[0], lora_alpha=default[1], use_rslora=use_rslora,
        target_modules=shorts, rank_pattern=rank_p, alpha_pattern=alpha_p,
        lora_dropout=dropout, base_model=base_model, use_dora=dora, family=info.family,
        target_parameters=parameters,
        trainable_token_indices={m: tokens for m in TOKEN_MODULES} if tokens else None)
    with atomic_directory(save, overwrite) as tmp:
        with StreamingSafetensorsWriter(os.path.join(tmp, WEIGHTS_NAME), entries) as w:
            layer_factors: List[Tuple[torch.Tensor, torch.Tensor]] = []
            for site in plan:
                a, b = ckpt.factors(site)
                m = ckpt.magnitude(site) if dora else None
                if fused and site.kind.name in peft_fused.ROUTED:
                    layer_factors.append((a, peft_fused.hf_b(site, b)))
                    if len(layer_factors) == info.shape.num_experts:  # the layer's last expert
                        for key, t in zip(peft_fused.keys(names, site.index[0], site.kind.name,
                                                          kinds),
                                          peft_fused.stack(layer_factors)):
                            w.write(key, t)
                        layer_factors = []
                    continue
                if site.kind.name == "embedding":
                    vocab = info.vocab_size
                    module = site.modules()[0]
                    a_key, b_key = peft_keys(module, True)
                    w.write(a_key, a[:, :vocab].contiguous())
                    w.write(b_key, b)
                    continue
                for part in site.parts:
                    rows = b[part.row0:part.row0 + part.rows]
                    m_parts = ({} if m is None else split_rows(
                        part, m[part.row0:part.row0 + part.rows].unsqueeze(1)))
                    for module, b_part in split_rows(part, rows).items():
                        a_key, b_key = peft_keys(module, False)
                        w.write(a_key, a)
                        w.write(b_key, b_part.contiguous())
                        if m is not None:
                            w.write(peft_magnitude_key(module), m_parts[module].reshape(-1)
                                    .contiguous())
                del a, b
            if tokens:
                for which, key in TOKEN_TENSORS.items():
                    w.write(key, ckpt.token_rows(which).contiguous())
        with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2)
        if tokens:
            _copy_tokenizer(ckpt.directory, tmp, notes)
    return config


# Our trainable-token tensors -> PEFT's module names and safetensors keys.
TOKEN_MODULES = ("embed_tokens", "lm_head")
TOKEN_TENSORS = {
    "embedding": "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta",
    "output_layer": "base_model.model.lm_head.token_adapter.trainable_tokens_delta",
}


def _copy_tokenizer(directory: str, out: str, notes: Optional[List[str]]) -> None:
    """The extended tokenizer train --add-special-tokens saved (RUN/tokenizer, beside the
    iteration folders) into the export folder, so the new tokens' ids come with the adapter."""
    import shutil

    run = os.path.dirname(os.path.abspath(directory))
    source = next((d for d in (os.path.join(directory, "tokenizer"), os.path.join(run, "tokenizer"))
                   if os.path.isfile(os.path.join(d, "tokenizer.json"))), None)
    if source is None:
        if notes is not None:
            notes.append(f"no extended tokenizer found beside {directory} (RUN/tokenizer, written "
                         f"by train --add-special-tokens with --save): add the new tokens to the "
                         f"tokenizer yourself, in the same order")
        return
    for name in os.listdir(source):
        shutil.copyfile(os.path.join(source, name), os.path.join(out, name))


def _export_prefix(ckpt: AdapterCheckpoint, info, save: str, overwrite: bool,
                   base_model: Optional[str], notes: Optional[List[str]]) -> dict:
    """A prefix-tuning checkpoint as PEFT's PREFIX_TUNING folder; returns the config."""
    from megatron_lora.export.peft_file import PROMPT_EMBEDDINGS

    cfg, s = ckpt.config, info.shape
    td = s.num_query_groups * info.head_dim  # PEFT's GQA token_dim
    table = ckpt.prefix_table().to(ckpt.dtype).contiguous()  # [n, L * 2 * td]
    config = prefix_config_dict(
        num_virtual_tokens=cfg.num_virtual_tokens, token_dim=td,
        num_attention_heads=s.num_query_groups, num_layers=s.num_layers,
        encoder_hidden_size=cfg.encoder_hidden_size or td,
        prefix_projection=cfg.prefix_projection, base_model=base_model)
    if cfg.prefix_projection and notes is not None:
        notes.append("prefix_projection: the projected prefix tanh(E W1^T + b1) W2^T + b2 is "
                     "written as prompt_embeddings, as PEFT saves it (PEFT loads it for "
                     "inference; E and the MLP are not part of PEFT's format)")
    with atomic_directory(save, overwrite) as tmp:
        entries = [(PROMPT_EMBEDDINGS, tuple(table.shape), table.dtype)]
        with StreamingSafetensorsWriter(os.path.join(tmp, WEIGHTS_NAME), entries) as w:
            w.write(PROMPT_EMBEDDINGS, table)
        with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2)
    return config


def _packed_note(names, values: dict) -> List[str]:
    """Multi-latent attention: vLLM packs q_a_proj and kv_a_proj_with_mqa into one module, so
    their adapters must share a rank there; say whether this export's do."""
    q_a, kv_a = short_name(module_of(names.q_a)), short_name(module_of(names.kv_a))
    ranks = {short_name(m): r for m, (r, _) in values.items()}
    if not names.mla or q_a not in ranks or kv_a not in ranks:
        return []
    if ranks[q_a] == ranks[kv_a]:
        return [f"{q_a} and {kv_a} have the same rank {ranks[q_a]} (vLLM packs them into one "
                f"module and needs that)"]
    return [f"{q_a} has rank {ranks[q_a]}, {kv_a} rank {ranks[kv_a]}: vLLM packs the two into "
            f"one module and cannot serve different ranks (transformers + PEFT can)"]
