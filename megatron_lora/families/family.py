"""What a model family is, as data, and the model description every tool reads (`ModelInfo`).

A `Family` says which Hugging Face configs it reads (`architectures` / `model_type`), how a config
becomes a `ModelShape` (`read`, validating every field it uses and refusing what megatron-core
cannot reproduce, naming the field), and its checkpoint's tensor names (`HFNames`). Conversion, the
export table, PEFT files, LoRA sizing, the CLI and the memory estimator read only these objects:
adding a family is one module in this package (see families/__init__.py for the registry).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Dict, Tuple

import torch

from megatron_lora.families.shape import VOCAB_MULTIPLE, ModelShape
from megatron_lora.runtime.layout import LayoutError, ParallelLayout


@dataclass(frozen=True)
class HFNames:
    """Tensor names of a family's Hugging Face checkpoint on disk: `{l}` is the layer index,
    `{e}` the expert index; per-layer names are relative to `layer`, per-expert names to
    `expert` (itself relative to `layer`). `mla`: the attention is multi-latent (q_a / q_b, or
    q for a model without q_lora_rank, kv_a / kv_b and their norms) instead of q / k / v."""

    router: str
    expert: str
    expert_gate: str
    expert_up: str
    expert_down: str
    embedding: str = "model.embed_tokens.weight"
    layer: str = "model.layers.{l}."
    input_norm: str = "input_layernorm.weight"
    q: str = "self_attn.q_proj.weight"
    k: str = "self_attn.k_proj.weight"
    v: str = "self_attn.v_proj.weight"
    o: str = "self_attn.o_proj.weight"
    q_norm: str = "self_attn.q_norm.weight"  # per-head norms, read when shape.qk_layernorm
    k_norm: str = "self_attn.k_norm.weight"
    shared_expert: str = "mlp.shared_expert."  # with expert_gate / _up / _down (shared experts)
    shared_expert_gate: str = "mlp.shared_expert_gate.weight"
    expert_bias: str = "mlp.gate.e_score_correction_bias"  # read when shape.moe_router_expert_bias
    dense_mlp: str = "mlp."  # a dense layer's MLP, with expert_gate / _up / _down
    post_attention_norm: str = "post_attention_layernorm.weight"
    final_norm: str = "model.norm.weight"
    output: str = "lm_head.weight"
    mla: bool = False
    q_a: str = "self_attn.q_a_proj.weight"
    q_a_norm: str = "self_attn.q_a_layernorm.weight"
    q_b: str = "self_attn.q_b_proj.weight"
    kv_a: str = "self_attn.kv_a_proj_with_mqa.weight"
    kv_a_norm: str = "self_attn.kv_a_layernorm.weight"
    kv_b: str = "self_attn.kv_b_proj.weight"

    def kind_modules(self) -> Dict[str, Tuple[str, ...]]:
        """{adapter kind (lora.targets): the short HF module names it covers, in row order} -
        PEFT's `target_modules` names of each kind."""
        s = _short
        qkv = (tuple(s(n) for n in (self.q_a, self.q_b, self.q, self.kv_a, self.kv_b)) if self.mla
               else (s(self.q), s(self.k), s(self.v)))
        return {"embedding": (s(self.embedding),), "linear_qkv": qkv,
                "linear_proj": (s(self.o),), "router": (s(self.router),),
                "linear_fc1": (s(self.expert_gate), s(self.expert_up)),
                "linear_fc2": (s(self.expert_down),), "output_layer": (s(self.output),)}

    def attention_linears(self) -> Tuple[str, ...]:
        """The per-layer names (relative to `layer`) of the attention's linear weights."""
        if self.mla:
            return (self.q_a, self.q_b, self.q, self.kv_a, self.kv_b, self.o)
        return (self.q, self.k, self.v, self.o)

    def peft_order(self) -> Tuple[str, ...]:
        """Short module names in the order an exported adapter_config.json lists them."""
        return tuple(m for ms in self.kind_modules().values() for m in ms)

    def parameter_modules(self) -> Tuple[str, ...]:
        """Short names of the modules transformers 5 keeps as fused parameters (router and
        routed experts), which PEFT adapts with lora.ParamWrapper."""
        k = self.kind_modules()
        return k["router"] + k["linear_fc1"] + k["linear_fc2"]


def _short(weight_name: str) -> str:
    """`model.layers.{l}.self_attn.q_proj.weight` -> `q_proj`."""
    return weight_name[: -len(".weight")].rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Family:
    """One model family.

    name: short name (`mixtral`), also the checkpoint format's (`megatron_lora.{name}.torch_dist`).
    architectures / model_types: the config.json values that select it.
    read: `read(fields, cfg) -> (ModelShape, real vocab size)`; raises ModelConfigError naming the
        field (`fields` is a families.fields.Fields over cfg).
    names: the HF tensor names.
    experts_field / ffn_field: the config fields giving the expert count and the expert FFN size
        (for messages that say which field a size comes from); dense_ffn_field: the dense
        layers' FFN size (models with dense layers between the MoE layers).
    transformers_module: the transformers module defining its model (PEFT's `parent_library`).
    peft_fused_experts: PEFT (0.21, on transformers 5) takes this family's router and routed-
        expert adapters only as `target_parameters` on the fused parameters (export/peft_fused.py);
        False: PEFT maps per-expert module names onto them itself (Mixtral, the Qwen3-MoE pattern).
    module_aliases: (in-memory name part, on-disk name part) pairs: PEFT adapters saved against
        transformers 5's modules name them by the in-memory path (Mixtral: `.mlp.` for
        `.block_sparse_moe.`); import reads both.
    refuses: one line per thing the family refuses, for the docs' family page.
    fused_experts: the checkpoint holds each layer's experts as fused tensors (GPT-OSS:
        `{layer}{expert}gate_up_proj` [E, h, 2f], gate and up interleaved on the last axis,
        `down_proj` [E, f, h], their `_bias` tensors; or MXFP4 `_blocks` / `_scales`), not one
        module per expert (convert/fused_experts.py).
    extra_layers_field: a config field counting layers the checkpoint holds after the
        `num_hidden_layers` decoder layers that the model does not build (GLM-4.5's
        multi-token-prediction layers, `num_nextn_predict_layers`): the model skips their
        tensors (saying so); conversion carries them unchanged back to HF (convert/carried.py);
        "": none.
    hf_defaults: {config.json field: what its absence means to transformers' config class}
        (families/hf_defaults.py).
    """

    name: str
    architectures: Tuple[str, ...]
    model_types: Tuple[str, ...]
    read: Callable = field(repr=False)
    names: HFNames = field(repr=False)
    experts_field: str
    ffn_field: str
    transformers_module: str
    dense_ffn_field: str = "intermediate_size"
    module_aliases: Tuple[Tuple[str, str], ...] = ()
    peft_fused_experts: bool = False
    refuses: Tuple[str, ...] = ()
    fused_experts: bool = False
    extra_layers_field: str = ""
    hf_defaults: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def base_model_class(self) -> str:
        """transformers' causal-LM class (PEFT's `auto_mapping.base_model_class`)."""
        return self.architectures[0]

    @property
    def checkpoint_format(self) -> str:
        return f"megatron_lora.{self.name}.torch_dist"

    def shape_fields(self) -> Tuple[str, ...]:
        """The config.json fields that fix tensor shapes, in message order."""
        return ("vocab_size", "hidden_size", self.ffn_field, "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", self.experts_field)


@dataclass(frozen=True)
class ModelInfo:
    """A model as megatron_lora builds it.

    family: its Family.
    shape: megatron sizes, with `shape.vocab_size` the padded vocabulary.
    vocab_size: the model's real vocabulary (rows of HF `embed_tokens`, columns of logits).
    dtype: the checkpoint's parameter dtype (config.json `dtype` / `torch_dtype`).
    hf_config: the config.json dict, kept to write it back on export.
    defaulted: the numeric fields config.json leaves out that took a transformers default, with
        the value taken (families/hf_defaults.py).
    """

    family: Family
    shape: ModelShape
    vocab_size: int
    dtype: torch.dtype
    hf_config: dict = field(repr=False, compare=False)
    defaulted: Tuple[Tuple[str, object], ...] = field(default=(), repr=False, compare=False)

    def defaults_note(self) -> str:
        """'' or, for messages about sizes, the fields config.json leaves out whose
        transformers defaults were taken (defaulted: ((field, value), ...), families/fields.py)."""
        if not self.defaulted:
            return ""
        said = ", ".join(f"{k}={v}" for k, v in self.defaulted)
        return (f" (config.json does not set {', '.join(k for k, _ in self.defaulted)}: "
                f"transformers' defaults {said} were taken; set them if they are not this "
                f"model's)")

    @property
    def head_dim(self) -> int:
        return self.shape.head_dim

    def config_fields(self) -> str:
        """The config.json fields that fix tensor shapes, for error messages."""
        c = self.hf_config
        return ", ".join(f"{n}={c.get(n)}" for n in self.family.shape_fields())

    def lora_sizes(self) -> SimpleNamespace:
        """The TransformerConfig fields the model's LoRA sizing reads (lora.sizes), from the
        sizes alone (pure: every rank finds the same before the model is built)."""
        s = self.shape
        return SimpleNamespace(
            num_layers=s.num_layers, hidden_size=s.hidden_size,
            num_attention_heads=s.num_attention_heads, num_query_groups=s.num_query_groups,
            kv_channels=self.head_dim,
            ffn_hidden_size=s.dense_ffn_hidden_size or s.ffn_hidden_size,
            moe_ffn_hidden_size=s.ffn_hidden_size, num_moe_experts=s.num_experts,
            moe_shared_expert_intermediate_size=s.shared_expert_ffn_hidden_size,
            moe_layer_freq=list(s.moe_layer_pattern) if s.moe_layer_pattern else 1,
            gated_linear_unit=True, **self._mla_sizes())

    def _mla_sizes(self) -> dict:
        """MLATransformerConfig's size fields of a multi-latent attention model; {} otherwise."""
        m = self.shape.mla
        if m is None:
            return {}
        return dict(multi_latent_attention=True, q_lora_rank=m.q_lora_rank,
                    kv_lora_rank=m.kv_lora_rank, qk_head_dim=m.qk_head_dim,
                    qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim)

    def layout_problems(self, layout: ParallelLayout, world_size: int,
                        flags: bool = False) -> list:
        """Every reason `layout` cannot run this model on `world_size` ranks (pure, no comms);
        flags: name the settings by their CLI flags (ParallelLayout.problems)."""
        problems = layout.problems(world_size, flags=flags, **self.shape.layout_sizes())
        m = self.shape.mla
        if m is not None:  # MLA's down projections split their rows over TP (models/mla.py)
            tp = f"--tensor-model-parallel-size {layout.tp}" if flags else f"tp={layout.tp}"
            sizes = (("q_lora_rank", m.q_lora_rank or 0),
                     ("kv_lora_rank + qk_rope_head_dim", m.kv_lora_rank + m.qk_pos_emb_head_dim))
            problems += [f"{tp} does not divide {name} = {size} (multi-latent attention)"
                         for name, size in sizes if size % layout.tp]
        if self.shape.vocab_size % layout.tp:
            tp = (f"--tensor-model-parallel-size {layout.tp}" if flags else f"tp={layout.tp}")
            problems.append(
                f"{tp} does not divide the padded vocabulary {self.shape.vocab_size} "
                f"(vocab_size={self.vocab_size} padded to a multiple of {VOCAB_MULTIPLE})"
            )
        return problems

    def validate_layout(self, layout: ParallelLayout, world_size: int,
                        flags: bool = False) -> None:
        """Raise LayoutError on every rank, before any collective, if the layout does not fit."""
        problems = self.layout_problems(layout, world_size, flags)
        if problems:
            raise LayoutError(problems)
