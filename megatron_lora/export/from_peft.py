"""PEFT LoRA adapter (per-expert or transformers-5 fused layout) -> adapter checkpoint.

    report = import_peft("my-adapter", "imported-lora", hf_config="Mixtral-8x7B-v0.1")

Each megatron adapter (a "site": one fused qkv of a layer, one expert's fc1, ...) is built from
the PEFT modules it covers:
- one module, or parts sharing one A bit for bit with equal scales (what `export peft` writes):
  A is that A, B's rows are the parts' B rows in megatron's order (q/k/v per query group, [w1; w3]);
  a part the adapter does not target gets zero rows. Rank unchanged.
- parts with different A (PEFT trained q, k, v separately): stacked, A = [A_q; A_k; A_v]
  ([r_q + r_k + r_v, in]), B block-diagonal (part i's rows hold B_i in columns of block i, zeros
  elsewhere), so B A = the parts' B_i A_i exactly: lossless, the rank adds up.
- transformers-5 fused experts: expert e's A = A.view(E, r, in)[e], B = B.view(out, r, E)[:, :, e]
  (gate_up_proj rows are already [w1; w3]).

Scaling: PEFT scales each part by alpha_i / r_i (alpha_i / sqrt(r_i) with rsLoRA). A site keeps
its parts' common scale s: megatron_lora's alpha becomes `alpha_for(s, new rank)` (alpha is
adjusted, the factors are copied bit for bit; the scale is exact, or within 1e-16 relative when no
double alpha gives it exactly, as can happen with rsLoRA's sqrt). Only when stacked parts have different scales is
the ratio s_i / s folded into B_i (one rounding per element, reported as `rescaled`).

Checkpoint tensors are stacked over layers and experts, so all sites of a kind share one rank:
sites with a smaller rank are padded with zero rows of A / columns of B (exact; alpha adjusted),
and layers the adapter does not touch get zero factors. The LoraConfig written to the checkpoint
has `rank_pattern` / `alpha_pattern` entries that give every site its rank and exact scale (checked
before writing).

DoRA (`use_dora: true`, attention only): each site's magnitude is its modules' magnitude rows in
megatron's order (q/k/v per query group), copied bit for bit; stacking, padding and rescaling
leave B A, and so the row norms, unchanged. Every row needs its magnitude (an untargeted row's
would be the base weight's norm, which the import does not read), so a DoRA adapter must cover
q_proj, k_proj and v_proj of every layer together, and o_proj of every layer if any.

Prefix tuning (PREFIX_TUNING): `prompt_embeddings` [n, L * 2 * td] becomes the checkpoint's
`prefix_kv` [L, n, 2, groups, head_dim] bit for bit, with a LoraConfig of num_virtual_tokens = n,
prefix_projection=False. A PEFT save with prefix_projection=true holds only the projected table
(not E and the MLP), so it imports as that table, prefix_projection=False (a note says so).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron_lora.convert.outputs import prepare_output_dir
from megatron_lora.convert.errors import ConversionError
from megatron_lora.export.peft_fused import megatron_b, refuse_fused_experts
from megatron_lora.export.adapter_ckpt import write_adapter_checkpoint
from megatron_lora.export.peft_config import PeftPrefix, alpha_for, read_adapter_config
from megatron_lora.export.peft_file import PeftAdapterFile
from megatron_lora.export.table import (KIND_BY_NAME, KIND_PATTERN, KINDS, Site, factor_shapes,
                                        fuse_rows, hf_short, model_kinds, sites)
from megatron_lora.families import read_hf_config
from megatron_lora.lora.model import LoraConfig


@dataclass
class Piece:
    """One PEFT adapter's contribution to a site. load() -> (A [rank, in], B) where B is
    {module: [module rows, rank]} or a full [site out, rank] tensor."""

    label: str
    rank: int
    scale: float
    load: Callable[[], Tuple[torch.Tensor, object]]


@dataclass
class SitePlan:
    site: Site
    pieces: List[Piece]
    shared: bool = True  # one A for all pieces
    rank: int = 0  # before padding
    scale: float = 1.0
    rescaled: bool = False
    notes: List[str] = field(default_factory=list)


def _pieces(pf: PeftAdapterFile, site: Site) -> List[Piece]:
    kind = site.kind.name
    if kind in ("linear_fc1", "linear_fc2") and pf.fused:
        layer, expert = site.index
        f = pf.fused.get((layer, "gate_up" if kind == "linear_fc1" else "down"))
        if f is None:
            return []
        E = pf.info.shape.num_experts

        def load(f=f, e=expert):
            a, b = pf.read(f.a_key), pf.read(f.b_key)
            return (a.reshape(E, f.rank, a.shape[1])[e].clone(),
                    megatron_b(site, b.reshape(b.shape[0], f.rank, E)[:, :, e]).contiguous())

        return [Piece(f.b_key.rsplit(".lora_B", 1)[0] + f"[expert {expert}]", f.rank, f.scale, load)]
    out = []
    for module in site.modules():
        f = pf.modules.get(module)
        if f is not None:
            out.append(Piece(module, f.rank, f.scale,
                             lambda f=f, m=module: (pf.read(f.a_key), {m: pf.read(f.b_key)})))
    return out


def _plan(pf: PeftAdapterFile, site: Site) -> Optional[SitePlan]:
    pieces = _pieces(pf, site)
    if not pieces:
        return None
    plan = SitePlan(site, pieces)
    scales = {p.scale for p in pieces}
    if len(pieces) > 1:
        first = pieces[0].load()[0]
        plan.shared = len(scales) == 1 and all(
            torch.equal(first, p.load()[0]) for p in pieces[1:])
    plan.rank = pieces[0].rank if plan.shared else sum(p.rank for p in pieces)
    plan.scale = pieces[0].scale
    plan.rescaled = len(scales) > 1
    if not plan.shared:
        plan.notes.append(f"{site.name}: stacked {[p.label for p in pieces]} ranks "
                          f"{[p.rank for p in pieces]} -> {plan.rank}")
    if plan.rescaled:
        plan.notes.append(f"{site.name}: parts have scales {[p.scale for p in pieces]}; "
                          f"B rescaled to {plan.scale}")
    return plan


def _site_factors(plan: Optional[SitePlan], site: Site, rank: int, a_cols: int, b_rows: int,
                  dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    a_out = torch.zeros(rank, a_cols, dtype=dtype, device="cpu")
    b_out = torch.zeros(b_rows, rank, dtype=dtype, device="cpu")
    if plan is None:
        return a_out, b_out
    col = 0
    by_module: Dict[str, torch.Tensor] = {}
    full: Optional[torch.Tensor] = None
    for i, piece in enumerate(plan.pieces):
        a, b = piece.load()
        width = piece.rank
        if plan.shared:
            if i == 0:
                a_out[:width, :a.shape[1]] = a
        else:
            a_out[col:col + width, :a.shape[1]] = a
        factor = piece.scale / plan.scale
        target = slice(0, width) if plan.shared else slice(col, col + width)
        if isinstance(b, dict):
            for module, rows in b.items():
                if factor != 1.0:
                    rows = (rows.float() * factor).to(dtype)
                padded = torch.zeros(rows.shape[0], rank, dtype=dtype, device="cpu")
                padded[:, target] = rows
                by_module[module] = padded
        else:
            full = torch.zeros(b_rows, rank, dtype=dtype, device="cpu")
            full[:b.shape[0], target] = b
        if not plan.shared:
            col += width
    if full is not None:
        return a_out, full
    if site.kind.name == "embedding":
        (rows,) = by_module.values()
        return a_out, rows
    pieces = [fuse_rows(part, {m: by_module.get(m, torch.zeros(rows, rank, dtype=dtype, device="cpu"))
                               for m, rows in _module_rows(part).items()}, rank, dtype)
              for part in site.parts]
    return a_out, torch.cat(pieces, dim=0)


def _module_rows(part) -> Dict[str, int]:
    from megatron_lora.export.table import module_of

    return {module_of(n): s[0] for n, s in part.source.hf_shapes().items()}


def _min_dim(info, kind) -> int:
    a, b = factor_shapes(info, kind, 1)
    return min(a[-1], b[-2]) if kind.name != "embedding" else min(a[-1], b[0])


def _lora_config(info, ranks: Dict[str, int], site_scales: Dict[str, Tuple[str, float]],
                 use_rslora: bool, dropout: float, use_dora: bool = False) -> LoraConfig:
    """A LoraConfig giving every site (global name -> (kind, scale)) its kind's rank and its
    scale exactly."""
    default_r = Counter(ranks.values()).most_common(1)[0][0]
    rank_pattern = {KIND_PATTERN[k]: r for k, r in ranks.items() if r != default_r}
    alphas = {name: (kind, alpha_for(s, ranks[kind], use_rslora))
              for name, (kind, s) in site_scales.items()}
    default_alpha = Counter(a for _, a in alphas.values()).most_common(1)[0][0]
    alpha_pattern: Dict[str, float] = {}
    per_kind: Dict[str, set] = {}
    for kind, a in alphas.values():
        per_kind.setdefault(kind, set()).add(a)
    for name, (kind, a) in alphas.items():  # kinds whose sites differ: one entry per site
        if len(per_kind[kind]) > 1 and a != default_alpha:
            alpha_pattern[f"^{re.escape(name)}$"] = a
    for kind, vals in per_kind.items():
        if len(vals) == 1 and next(iter(vals)) != default_alpha:
            alpha_pattern[KIND_PATTERN[kind]] = next(iter(vals))
    config = LoraConfig(r=default_r, lora_alpha=default_alpha, lora_dropout=dropout,
                        target_modules=[k.target_kind for k in KINDS if k.name in ranks
                                        and k.target == ""],
                        use_rslora=use_rslora,
                        rank_pattern=rank_pattern, alpha_pattern=alpha_pattern, use_dora=use_dora)
    for name, (kind, s) in site_scales.items():
        got = config.adapter_config(name)
        if got.rank != ranks[kind] or not math.isclose(got.scaling, s, rel_tol=1e-15):
            raise AssertionError(f"LoraConfig gives {name} rank {got.rank} scale {got.scaling}, "
                                 f"wanted {ranks[kind]}, {s}")
    return config


def _check_dora_cover(pf: PeftAdapterFile, plans) -> None:
    """Every row of every DoRA kind has a magnitude in the file (see the module docstring)."""
    for kind, entries in plans.items():
        for site, _ in entries:
            missing = [m for m in site.modules() if m not in pf.magnitudes]
            if missing:
                raise ConversionError(
                    f"{pf.path}: DoRA adapter (use_dora=true) without {missing[:3]}: importing "
                    f"DoRA needs every layer's {' / '.join(hf_short(pf.info, site.kind))} adapted "
                    f"together (an untargeted row's magnitude would be its base weight's norm)")


def import_peft(adapter_dir: str, save: str, *, hf_config: str, overwrite: bool = False) -> dict:
    """Convert a PEFT LoRA folder into an adapter checkpoint at `save` (atomically).

    Returns a report: {"ranks": {kind: rank}, "config": LoraConfig.to_dict(), "notes": [...]}
    (notes: stacked sites with their ranks, rescaled sites, zero-padded and zero sites; for
    prefix tuning ranks is {} and a note says when a projection was imported as its table)."""
    prepare_output_dir(save, overwrite=overwrite,
                       inputs={"--adapter": adapter_dir, "--load-hf": hf_config})
    info = read_hf_config(hf_config)
    refuse_fused_experts(info)
    cfg = read_adapter_config(adapter_dir)
    if isinstance(cfg, PeftPrefix):
        return _import_prefix(adapter_dir, save, info, cfg, overwrite)
    pf = PeftAdapterFile(adapter_dir, info, cfg)
    plans: Dict[str, List[Tuple[Site, Optional[SitePlan]]]] = {}
    ranks: Dict[str, int] = {}
    notes: List[str] = []
    kinds = model_kinds(info)
    for kind in kinds:
        entries = [(s, _plan(pf, s)) for s in sites(info, kind)]
        if all(p is None for _, p in entries):
            continue
        rank = max(p.rank for _, p in entries if p is not None)
        if rank > _min_dim(info, kind):
            raise ConversionError(
                f"{pf.path}: {kind.name} needs rank {rank} after fusing "
                f"{list(hf_short(info, kind))}, more than min(in, out) = {_min_dim(info, kind)} of the "
                f"megatron weight")
        plans[kind.name], ranks[kind.name] = entries, rank
        for s, p in entries:
            if p is None:
                notes.append(f"{s.name}: not in the adapter, zero factors")
            else:
                notes += p.notes
                if p.rank < rank:
                    notes.append(f"{s.name}: rank {p.rank} zero-padded to {rank}")
    scale_of = {k: next(p.scale for _, p in entries if p is not None)
                for k, entries in plans.items()}
    for kind in kinds:  # a target kind covers all its table kinds (routed and shared experts)
        sibling = next((k for k in plans if KIND_BY_NAME[k].target_kind == kind.target_kind),
                       None)
        if kind.name not in plans and sibling is not None:
            plans[kind.name] = [(s, None) for s in sites(info, kind)]
            ranks[kind.name], scale_of[kind.name] = ranks[sibling], scale_of[sibling]
            notes.append(f"{kind.name}: not in the adapter, zero factors")
    site_scales = {}
    for kind, entries in plans.items():
        for s, p in entries:
            site_scales[s.name] = (kind, p.scale if p is not None else scale_of[kind])
    if cfg.use_dora:
        _check_dora_cover(pf, plans)
    config = _lora_config(info, ranks, site_scales, cfg.use_rslora, 0.0, cfg.use_dora)
    extra = {}
    if cfg.trainable_token_indices:  # PEFT's trainable tokens: rows of embed_tokens and lm_head
        import dataclasses

        from megatron_lora.export.adapter_ckpt import TOKEN_KEYS

        # ids past the padded vocabulary are fine: the model is built for them when loaded
        # (trainable_tokens.info_for_tokens)
        config = dataclasses.replace(config, trainable_token_indices=cfg.trainable_token_indices)
        extra = {TOKEN_KEYS[w]: pf.read(key) for w, key in pf.tokens.items()}
    by_name = {s.name: p for entries in plans.values() for s, p in entries}

    def factors(site: Site):
        a_shape, b_shape = factor_shapes(info, site.kind, ranks[site.kind.name])
        a, b = _site_factors(by_name[site.name], site, ranks[site.kind.name], a_shape[-1],
                             b_shape[-2], pf.dtype)
        if not cfg.use_dora:
            return a, b
        m = torch.cat([fuse_rows(part, {mod: pf.read(pf.magnitudes[mod]).unsqueeze(1)
                                        for mod in _module_rows(part)}, 1, pf.dtype)
                       for part in site.parts]).reshape(-1)
        return a, b, m

    write_adapter_checkpoint(save, info, ranks, factors, config, pf.dtype,
                             run_metadata={"imported_from": adapter_dir}, overwrite=overwrite,
                             extra=extra)
    return {"ranks": ranks, "config": config.to_dict(), "notes": notes}


def _import_prefix(adapter_dir: str, save: str, info, cfg: PeftPrefix, overwrite: bool) -> dict:
    """A PEFT PREFIX_TUNING folder -> a prefix-tuning adapter checkpoint (prefix_projection
    False, the saved table [n, L * 2 * td] as prefix_kv [L, n, 2, groups, head_dim])."""
    from megatron_lora.export.adapter_ckpt import prefix_tensors
    from megatron_lora.export.peft_file import read_prefix_table

    table = read_prefix_table(adapter_dir, info, cfg)
    notes = []
    if cfg.prefix_projection:
        notes.append(f"{cfg.path}: prefix_projection=true, but PEFT saves only the projected "
                     f"prefix (tanh(E W1^T + b1) W2^T + b2, not E and the MLP): imported as "
                     f"prefix_projection=False with that table (the same keys and values; "
                     f"further training trains the table)")
    config = LoraConfig(num_virtual_tokens=cfg.num_virtual_tokens, target_modules=())
    write_adapter_checkpoint(save, info, {}, None, config, table.dtype,
                             run_metadata={"imported_from": adapter_dir}, overwrite=overwrite,
                             extra=prefix_tensors(info, table))
    return {"ranks": {}, "config": config.to_dict(), "notes": notes}
