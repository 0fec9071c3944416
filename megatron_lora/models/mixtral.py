"""Mixtral in megatron-core, configured from a Hugging Face `config.json`.

`MixtralInfo.from_hf_config(cfg)` checks that a config describes a model megatron-core reproduces
exactly (Mixtral architecture, SiLU experts, plain RoPE, no biases, no effective sliding window)
and turns it into a `ModelShape`. The vocabulary is padded to a multiple of `VOCAB_MULTIPLE` (128)
rows, the same for every layout, so one checkpoint loads at any TP that divides the padded
vocabulary; the padded rows are zero and `logits` drops their columns.

`mixtral_block_spec` picks the layer spec: Transformer Engine layers when TE is importable and
requested (GPU), otherwise the local spec with the sequence-parallel RMSNorm (CPU or GPU). Both
specs have the same sharded-state-dict keys, so one checkpoint serves both.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional

import torch

from megatron_lora.jsonfile import json_value, read_json, short
from megatron_lora.models.gpt import ModelShape, transformer_config
from megatron_lora.runtime.layout import LayoutError, ParallelLayout

VOCAB_MULTIPLE = 128
MIXTRAL_ARCHITECTURES = ("MixtralForCausalLM",)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MixtralConfigError(ValueError):
    """A config.json that is not a Mixtral model megatron_lora can reproduce; names the field."""


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """Smallest multiple of `multiple` that is >= vocab_size (layout independent)."""
    return -(-vocab_size // multiple) * multiple


_MISSING = object()
_TYPE_NAMES = {bool: "true or false", int: "an integer", str: "a string", list: "a list",
               dict: "an object"}


def _finite(x) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int beyond float range
        return False


class _Fields:
    """Typed access to config.json fields; errors read `{source}: field 'name' must be ..., got
    <the value as JSON>`."""

    def __init__(self, cfg: dict, source: str, prefix: str = ""):
        self.cfg, self.source, self.prefix = cfg, source, prefix

    def bad(self, name: str, must: str, value) -> MixtralConfigError:
        got = "nothing (the field is missing)" if value is _MISSING else json_value(value)
        return MixtralConfigError(
            f"{self.source}: field '{self.prefix}{name}' {must}, got {got}")

    def get(self, name: str, kind: type, default=_MISSING, nullable: bool = False):
        """cfg[name], which must be JSON of type `kind` (bool is not int; null only if
        `nullable`); `default` when the field is absent (required when no default)."""
        value = self.cfg.get(name, _MISSING)
        if value is _MISSING and default is not _MISSING:
            return default
        if value is None and nullable:
            return None
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if not ok:
            raise self.bad(name, f"must be {_TYPE_NAMES[kind]}{' or null' if nullable else ''}",
                           value)
        return value

    def integer(self, name: str, default=_MISSING, nullable: bool = False):
        """A positive JSON integer (1e9 or 4.0 are floats, refused)."""
        value = self.cfg.get(name, _MISSING)
        if value is _MISSING and default is not _MISSING:
            return default
        if value is None and nullable:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise self.bad(name, "must be a positive integer" + (" or null" if nullable else ""),
                           value)
        return value

    def number(self, name: str, default=_MISSING):
        """A positive, finite JSON number."""
        value = self.cfg.get(name, _MISSING)
        if value is _MISSING and default is not _MISSING:
            return default
        if (not isinstance(value, (int, float)) or isinstance(value, bool)
                or not _finite(value) or value <= 0):
            raise self.bad(name, "must be a positive number", value)
        return value


@dataclass(frozen=True)
class MixtralInfo:
    """A Mixtral model as megatron_lora builds it.

    shape: megatron sizes, with `shape.vocab_size` the padded vocabulary.
    vocab_size: the model's real vocabulary (rows of HF `embed_tokens`, columns of logits).
    dtype: the checkpoint's parameter dtype (config.json `dtype` / `torch_dtype`).
    hf_config: the config.json dict, kept to write it back on export.
    """

    shape: ModelShape
    vocab_size: int
    dtype: torch.dtype
    hf_config: dict = field(repr=False, compare=False)

    @property
    def head_dim(self) -> int:
        return self.shape.hidden_size // self.shape.num_attention_heads

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> "MixtralInfo":
        """Validate a Hugging Face Mixtral config dict; raise MixtralConfigError naming the field.

        Every field is checked for its JSON type as transformers' MixtralConfig declares it
        (a bool must be true/false, not "false"; integers are not floats or bools; numbers are
        finite), and null is accepted only where MixtralConfig accepts None."""
        f = _Fields(cfg, source)
        archs = f.get("architectures", list, default=[], nullable=True) or []
        if not all(isinstance(a, str) for a in archs):
            raise f.bad("architectures", "must be a list of strings", archs)
        model_type = f.get("model_type", str, default=None, nullable=True)
        if not (set(archs) & set(MIXTRAL_ARCHITECTURES)) and model_type != "mixtral":
            raise MixtralConfigError(
                f"{source}: architectures={archs} (model_type={model_type!r}) is not a Mixtral "
                f"model; supported: {list(MIXTRAL_ARCHITECTURES)}"
            )
        heads = f.integer("num_attention_heads")
        hidden = f.integer("hidden_size")
        vocab = f.integer("vocab_size")
        act = f.get("hidden_act", str, default="silu")
        if act != "silu":
            raise MixtralConfigError(
                f"{source}: field hidden_act={short(act)}: only 'silu' is supported")
        head_dim = f.integer("head_dim", default=None, nullable=True)
        if head_dim is not None and head_dim * heads != hidden:
            raise MixtralConfigError(
                f"{source}: field head_dim={head_dim} differs from hidden_size/"
                f"num_attention_heads={hidden}/{heads}; megatron_lora supports head_dim = "
                f"hidden_size/num_attention_heads"
            )
        for name in ("attention_bias", "mlp_bias"):
            if f.get(name, bool, default=False):
                raise MixtralConfigError(f"{source}: field {name}=true: biases are not supported")
        rope = f.get("rope_parameters", dict, default=None, nullable=True) or {}
        scaling = f.get("rope_scaling", dict, default=None, nullable=True) or {}
        rope_type = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type != "default":
            raise MixtralConfigError(f"{source}: field rope_type={short(rope_type)}: only unscaled "
                                     f"('default') RoPE is supported")
        if "rope_theta" in rope:
            theta = _Fields(rope, source, "rope_parameters.").number("rope_theta")
        else:
            theta = f.number("rope_theta", default=1e6)
        if float(theta) != int(theta):
            raise f.bad("rope_theta", "must be a positive whole number", theta)
        max_pos = f.integer("max_position_embeddings", default=131072)
        window = f.integer("sliding_window", default=None, nullable=True)
        if window is not None and window < max_pos:
            raise MixtralConfigError(
                f"{source}: field sliding_window={window} is smaller than max_position_embeddings="
                f"{max_pos}; sliding-window attention is not supported"
            )
        dtype_name = f.get("dtype", str, default=None, nullable=True)
        if dtype_name is None:
            dtype_name = f.get("torch_dtype", str, default=None, nullable=True) or "float32"
        if dtype_name not in _DTYPES:
            raise MixtralConfigError(
                f"{source}: field dtype={dtype_name!r}: expected one of {sorted(_DTYPES)}")
        kv_heads = f.integer("num_key_value_heads", default=heads, nullable=True)
        sizes = dict(  # read before ModelShape: a field error is not a derived-size error
            ffn_hidden_size=f.integer("intermediate_size"),
            num_layers=f.integer("num_hidden_layers"),
            num_experts=f.integer("num_local_experts"),
            moe_router_topk=f.integer("num_experts_per_tok"),
            norm_epsilon=float(f.number("rms_norm_eps", default=1e-5)),
            tie_embeddings=f.get("tie_word_embeddings", bool, default=False),
        )
        try:
            shape = ModelShape(
                vocab_size=padded_vocab_size(vocab), hidden_size=hidden,
                num_attention_heads=heads, num_query_groups=heads if kv_heads is None else kv_heads,
                max_position_embeddings=max_pos, rotary_base=float(theta), **sizes)
        except ValueError as exc:
            raise MixtralConfigError(
                f"{source}: {str(exc).replace('ModelShape.', 'derived ')}") from exc
        return cls(shape=shape, vocab_size=vocab, dtype=_DTYPES[dtype_name], hf_config=dict(cfg))

    def config_fields(self) -> str:
        """The config.json fields that fix tensor shapes, for error messages."""
        c = self.hf_config
        names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "num_local_experts")
        return ", ".join(f"{n}={c.get(n)}" for n in names)

    def lora_problems(self, lora, **names) -> list:
        """Every problem of LoraConfig `lora` for this model, from the sizes alone (pure: every
        rank finds the same ones before the model is built). names: rank_name / targets_name
        for the messages (a CLI passes its flags)."""
        from megatron_lora.lora.sizes import config_problems

        s = self.shape
        sizes = SimpleNamespace(  # the TransformerConfig fields mixtral_config sets
            num_layers=s.num_layers, hidden_size=s.hidden_size,
            num_attention_heads=s.num_attention_heads, num_query_groups=s.num_query_groups,
            kv_channels=self.head_dim, ffn_hidden_size=s.ffn_hidden_size,
            moe_ffn_hidden_size=s.ffn_hidden_size, num_moe_experts=s.num_experts,
            gated_linear_unit=True)
        return config_problems(lora, sizes, s.vocab_size, **names)

    def layout_problems(self, layout: ParallelLayout, world_size: int,
                        flags: bool = False) -> list:
        """Every reason `layout` cannot run this model on `world_size` ranks (pure, no comms);
        flags: name the settings by their CLI flags (ParallelLayout.problems)."""
        problems = layout.problems(world_size, flags=flags, **self.shape.layout_sizes())
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


def read_hf_config(path: str) -> MixtralInfo:
    """MixtralInfo from a config.json file (or a directory holding one)."""
    if os.path.isdir(path):  # a model folder's config.json must resolve inside the folder
        from megatron_lora.runtime.folder_files import folder_file

        path = folder_file(path, "config.json", MixtralConfigError)
    cfg = read_json(path, MixtralConfigError)
    if not isinstance(cfg, dict):
        raise MixtralConfigError(f"{path}: expected a JSON object, got {json_value(cfg)}")
    return MixtralInfo.from_hf_config(cfg, source=path)


def te_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def default_grouped_experts() -> bool:
    """What moe_grouped_gemm=None means for the local spec: grouped experts on CUDA only."""
    return torch.cuda.is_available()


def mixtral_block_spec(config, pp_rank: Optional[int] = None, use_te: Optional[bool] = None,
                       attention_backend: Optional[str] = None,
                       moe_grouped_gemm: Optional[bool] = None):
    """TransformerBlock spec for this pipeline stage.

    use_te: True requires Transformer Engine (TE linears fused with RMSNorm, TENorm final norm,
    SequentialMLP experts of TE linears); False is the local spec; None picks TE when it is
    importable and CUDA is usable.
    attention_backend: Megatron-LM's `--attention-backend` name for the local spec's core
    attention (models.specs); None keeps megatron's DotProductAttention. The TE spec always uses
    TEDotProductAttention (None or "auto" only).
    moe_grouped_gemm: GroupedExperts (models/grouped_experts.py) instead of SequentialMLP in the
    local spec; checkpoints are the same either way. None (the default): grouped experts with
    the local spec on CUDA (where torch._grouped_mm runs them), SequentialMLP on CPU (where the
    grouped loop measured 5-8% slower than SequentialMLP, docs/training.md) and with the TE
    spec; True with the TE spec is refused.
    """
    from megatron_lora.models.specs import core_attention_class, local_block_spec

    core_attention_class(attention_backend)  # an unknown or unsupported name fails first
    if use_te is None:
        use_te = te_available() and torch.cuda.is_available()
    if not use_te:
        return local_block_spec(config, pp_rank=pp_rank, attention_backend=attention_backend,
                                moe_grouped_gemm=default_grouped_experts()
                                if moe_grouped_gemm is None else moe_grouped_gemm)
    if moe_grouped_gemm:
        raise ValueError(
            "grouped experts (--moe-grouped-gemm) are built from the local spec; the Transformer "
            "Engine spec keeps SequentialMLP experts (pass use_te=False, or no --moe-grouped-gemm)"
        )
    if attention_backend not in (None, "auto"):
        raise ValueError(
            f"attention backend {attention_backend!r} selects the local spec's core attention; "
            "the Transformer Engine spec uses TEDotProductAttention (pass use_te=False or "
            "attention backend 'auto')"
        )
    if not te_available():
        raise RuntimeError("use_te=True but transformer_engine is not importable")
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (
        TransformerBlock,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = get_gpt_layer_with_transformer_engine_spec(config.num_moe_experts, moe_grouped_gemm=False)
    # TE fuses the input norm into linear_qkv (key linear_qkv.layer_norm_weight); the MoE
    # pre-MLP norm is a separate TENorm. Store it under the same key as the local spec does, so
    # one checkpoint serves both specs.
    keys_map = dict(layer.submodules.sharded_state_dict_keys_map or {})
    keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    layer = dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, sharded_state_dict_keys_map=keys_map))
    num_layers = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=TENorm),
    )


def mixtral_config(info: MixtralInfo, layout: ParallelLayout, *, dtype: torch.dtype = torch.float32,
                   dispatcher: str = "allgather", **overrides):
    """megatron-core TransformerConfig for `info` at `layout` (RMSNorm, SwiGLU, top-k softmax
    router without load balancing, RoPE from config.json)."""
    return transformer_config(info.shape, layout, dtype=dtype, dispatcher=dispatcher, **overrides)


def build_mixtral_model(info: MixtralInfo, config, use_te: Optional[bool] = None,
                        attention_backend: Optional[str] = None,
                       moe_grouped_gemm: Optional[bool] = None):
    """This pipeline stage's GPTModel for `info` (megatron parallel state must be initialised).

    attention_backend, moe_grouped_gemm: see mixtral_block_spec (None keeps megatron's
    DotProductAttention; None grouped experts on the local spec).

    The model's vocabulary is the padded one ([Vp/tp, h] embedding and output shards per TP rank);
    its logits are [b, s, Vp/tp] per TP rank with parallel_output=True.
    """
    from megatron.core import parallel_state

    from megatron_lora.models.gpt import build_gpt_model

    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    spec = mixtral_block_spec(config, pp_rank=pp_rank, use_te=use_te,
                              attention_backend=attention_backend,
                              moe_grouped_gemm=moe_grouped_gemm)
    return build_gpt_model(info.shape, config, block_spec=spec)
