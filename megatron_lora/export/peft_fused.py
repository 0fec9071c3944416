"""PEFT's layout for routed experts kept fused by transformers 5, adapted by `lora.ParamWrapper`
through `target_parameters` (families with `Family.peft_fused_experts`).

transformers 5 stores a layer's experts as 3-D parameters and the router as a module with a bare
`weight` [E, h]; PEFT takes adapters on them only as parameters. Two orientations exist:
Qwen2-MoE's `{experts}gate_up_proj` [E, 2f, h] (rows [gate; up], as megatron's fc1) and
`down_proj` [E, h, f]; GPT-OSS's [E, in, out] (`gate_up_proj` [E, h, 2f] with gate and up
interleaved on the last axis, `down_proj` [E, f, h]; transformers marks the experts module
`is_transposed`). ParamWrapper reads (E, in, out) from an `is_transposed` parameter and swaps a
plain one, so both give the same factor shapes and update B_e A_e per expert ([out, in]):

| megatron kind | target_parameters entry    | lora_A            | lora_B                      |
|---------------|----------------------------|-------------------|-----------------------------|
| linear_fc1    | mlp.experts.gate_up_proj   | [E r, h]          | [2f, E r]                   |
| linear_fc2    | mlp.experts.down_proj      | [E r, f]          | [h, E r]                    |
| router        | mlp.gate.weight            | [r, h]            | [E, r]                      |

(GPT-OSS's router: `mlp.router.weight`.) A's rows are expert-major (expert e's A is rows
e r .. (e+1) r); B's column j is rank j // E of expert j % E (export/from_peft.py reads the same
layout); B's rows follow the parameter's out axis: [gate; up] for Qwen2-MoE, interleaved (row 2j
gate j, 2j + 1 up j) for GPT-OSS, whose expert sites say so (convert/fused_experts.py
`OneExpert`: `hf_b` / `megatron_b`). With both expert parameters targeted PEFT nests the wrappers
on one module: gate_up_proj (listed first) is `experts.base_layer`, down_proj is `experts`; with
one, it is `experts`. Every expert shares the wrapper's r and alpha, so the routed experts must
all have one rank and scale; ParamWrapper applies no dropout (lora_dropout 0 is written:
peft_config.inference_dropout).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from megatron_lora.convert.errors import ConversionError
from megatron_lora.convert.fused_experts import OneExpert
from megatron_lora.export.table import PEFT_PREFIX

ROUTED = ("linear_fc1", "linear_fc2")
_PARAM = {"linear_fc1": "gate_up_proj", "linear_fc2": "down_proj"}


def experts_module(names, layer: int) -> str:
    """HF module path of layer `layer`'s fused experts (`model.layers.3.mlp.experts`)."""
    return (names.layer + names.expert.split("{e}")[0]).format(l=layer).rstrip(".")


def target_parameters(names, kinds) -> List[str]:
    """target_parameters entries for the adapted kinds (router and routed experts), in the order
    PEFT's nesting of the keys assumes."""
    out = []
    if "router" in kinds:
        out.append(names.router)  # relative to the layer: `mlp.gate.weight`
    experts = names.expert.split("{e}")[0]
    out += [experts + _PARAM[k] for k in ROUTED if k in kinds]
    return out


def keys(names, layer: int, kind: str, kinds) -> Tuple[str, str]:
    """(lora_A key, lora_B key) of one layer's fused `kind` adapter."""
    module = experts_module(names, layer)
    if kind == "linear_fc1" and "linear_fc2" in kinds:
        module += ".base_layer"
    return PEFT_PREFIX + module + ".lora_A.weight", PEFT_PREFIX + module + ".lora_B.weight"


def stack(factors: List[Tuple[torch.Tensor, torch.Tensor]]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-expert (A_e [r, in], B_e [out, r]) in expert order -> PEFT's (A [E r, in], B [out, E r])."""
    a = torch.cat([a for a, _ in factors], dim=0)
    b = torch.stack([b for _, b in factors], dim=2)  # [out, r, E]: column j = (j // E, j % E)
    return a.contiguous(), b.reshape(b.shape[0], -1).contiguous()


def shapes(info, kind: str, rank: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    s = info.shape
    E, h, f = s.num_experts, s.hidden_size, s.ffn_hidden_size
    if kind == "linear_fc1":
        return (E * rank, h), (2 * f, E * rank)
    return (E * rank, f), (h, E * rank)


def hf_b(site, b: torch.Tensor) -> torch.Tensor:
    """One expert's B [out, r] in megatron's rows -> the rows of PEFT's lora_B for it (the fused
    parameter's out axis)."""
    source = site.parts[0].source
    return source.hf_rows(b) if isinstance(source, OneExpert) else b


def megatron_b(site, b: torch.Tensor) -> torch.Tensor:
    """The inverse of hf_b."""
    source = site.parts[0].source
    return source.megatron_rows(b) if isinstance(source, OneExpert) else b


def check_uniform(values: Dict[str, Tuple[int, float]], modules, what: str,
                  source: str) -> Tuple[int, float]:
    """The one (r, alpha) every module of `modules` has; ConversionError naming the adapter
    `source` and the flags otherwise."""
    found = {values[m] for m in modules}
    if len(found) != 1:
        raise ConversionError(
            f"{source}: the {what} adapters have different (rank, alpha) {sorted(found)} "
            f"(--lora-rank-pattern / --lora-alpha-pattern): PEFT takes them with one rank and "
            f"alpha; export the merged model instead (megatron-lora export hf --merge)")
    return found.pop()


def refuse_fused_experts(info) -> None:
    """A family whose checkpoint fuses the experts per layer (Family.fused_experts) has PEFT
    files only through `target_parameters` (Family.peft_fused_experts): refuse before any work
    when its family does not say PEFT takes them so."""
    if info.family.fused_experts and not info.family.peft_fused_experts:
        raise ConversionError(
            f"PEFT adapters for {info.family.base_model_class} (fused experts without "
            f"target_parameters) are not supported; export the merged model instead "
            f"(megatron-lora export hf --merge)")
