"""LoRA on whole megatron-core models: LoraConfig, apply_lora and the functions around it.

    config = LoraConfig(r=16, lora_alpha=32, target_modules=["linear_qkv", "linear_proj",
                        "linear_fc1", "linear_fc2"], rank_pattern={"experts": 8})
    adapters = apply_lora(model, config)        # wraps in place, freezes everything else
    params = get_adapter_params(model)          # {name: Parameter}, the trainable ones

Every adapter's initial factors come from (config.seed, its global name) (lora/identity.py), so
the same config gives the same global adapters at every parallel layout.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from megatron_lora import runtime
from megatron_lora.families.shape import MLA_INPUTS
from megatron_lora.lora.adapter import LoraAdapter
from megatron_lora.lora.config import AdapterConfig
from megatron_lora.lora.embedding import EmbeddingLora, wrap_embedding, wrap_output_layer
from megatron_lora.lora.experts import ExpertLora, wrap_experts
from megatron_lora.lora.router import RouterLora, wrap_router
from megatron_lora.lora.sizes import config_problems, model_kinds  # noqa: F401 (re-exported)
from megatron_lora.lora.identity import adapter_seed, dropout_stream, global_layer_prefix
from megatron_lora.lora.prefix import ENCODER as PREFIX_ENCODER
from megatron_lora.lora.prefix import SHARED as PREFIX_SHARED
from megatron_lora.lora.prefix import apply_prefix, prefix_problems
from megatron_lora.lora.prefix_config import check_prefix_fields
from megatron_lora.lora.targets import UnknownTargetError, normalize_targets
from megatron_lora.lora.trainable_tokens import DELTA as TOKENS_DELTA
from megatron_lora.lora.trainable_tokens import model_token_problems, wrap_model_tokens


# The attention's input projections, which the target kind linear_qkv covers: fused q/k/v, or
# multi-latent attention's (q down/up or one q projection, kv down/up), in megatron's names.
ATTENTION_INPUTS = ("linear_qkv",) + MLA_INPUTS
_DORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class LoraConfig:
    """PEFT-style LoRA settings for a whole model (validated on construction).

    r, lora_alpha, lora_dropout, use_rslora, init_lora_weights: as in HF PEFT.
    target_modules: megatron names (linear_qkv, linear_proj, linear_fc1, linear_fc2, router,
        embedding, output_layer), their HF names (q_proj ... w1, w2, w3, gate, embed_tokens,
        lm_head) or "all-linear".
    rank_pattern / alpha_pattern: {regex: value}; the first pattern found (re.search) in an
        adapter's global name (e.g. "decoder.layers.3.mlp.experts.5.linear_fc1") overrides r /
        lora_alpha for it, e.g. {"experts": 8}.
    seed: seeds every adapter's initial factors together with its global name.
    dtype: the adapter parameters' dtype (A, B and DoRA's magnitude; train --lora-dtype): "fp32",
        "bf16" or "fp16" (also "float32" / "bfloat16" / "float16" or a torch dtype, all stored
        as the torch dtype), or None: the base weight's dtype. The base keeps its own dtype; the
        adapter's matmuls run in the activation dtype (a factor of another dtype is cast to it,
        a weight-sized cast, and its gradient cast back), its output in the base output's dtype.
        Half adapters train with fp32 master weights in megatron's optimizer
        (training/optimizer.py) and are checkpointed and exported in their dtype.
    use_dora: DoRA (PEFT's `use_dora`, train --lora-use-dora) on linear_qkv, linear_proj and
        the experts' / MLP's linear_fc1, linear_fc2 (lora/dora.py); other targets are refused.
    trainable_token_indices: token ids whose embedding and output-layer rows are trained
        (PEFT's `trainable_token_indices`, train --add-special-tokens; lora/trainable_tokens.py);
        not combinable with LoRA on embedding / output_layer.
    num_virtual_tokens: > 0 makes this a prefix-tuning config (PEFT's PREFIX_TUNING, train
        --peft-type prefix; lora/prefix.py): that many learned key/value pairs per layer, and
        target_modules must be empty (PEFT loads one adapter type per adapter).
    prefix_projection, encoder_hidden_size: PEFT's; the prefix comes from a shared two-layer MLP
        of hidden size encoder_hidden_size (None: groups x head_dim, PEFT's default).
    """

    r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: Union[str, Sequence[str]] = ("linear_qkv", "linear_proj", "linear_fc1",
                                                 "linear_fc2")
    use_rslora: bool = False
    init_lora_weights: Union[bool, str] = True
    rank_pattern: Dict[str, int] = field(default_factory=dict)
    alpha_pattern: Dict[str, float] = field(default_factory=dict)
    seed: int = 0
    dtype: Optional[torch.dtype] = None
    use_dora: bool = False
    trainable_token_indices: Tuple[int, ...] = ()
    num_virtual_tokens: int = 0
    prefix_projection: bool = False
    encoder_hidden_size: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", lora_dtype(self.dtype))
        if check_prefix_fields(self):  # prefix tuning: no LoRA fields to check
            return
        tokens = tuple(int(i) for i in (self.trainable_token_indices or ()))
        object.__setattr__(self, "trainable_token_indices", tokens)
        both = [t for t in ("embedding", "output_layer") if t in normalize_targets(
            self.target_modules)]
        if tokens and both:
            raise ValueError(f"LoraConfig.trainable_token_indices (--add-special-tokens) cannot be "
                             f"combined with LoRA on {both} (--lora-target-modules)")
        object.__setattr__(self, "target_modules", normalize_targets(self.target_modules))
        no_dora = [t for t in self.target_modules if t not in _DORA_TARGETS]
        if self.use_dora is True and no_dora:
            raise ValueError(f"LoraConfig.use_dora (--lora-use-dora) supports the targets "
                             f"{list(_DORA_TARGETS)}, not {no_dora}")
        object.__setattr__(self, "rank_pattern", dict(self.rank_pattern))
        object.__setattr__(self, "alpha_pattern", dict(self.alpha_pattern))
        for pattern in list(self.rank_pattern) + list(self.alpha_pattern):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"LoraConfig rank_pattern/alpha_pattern key {pattern!r} is not a "
                                 f"valid regular expression: {e}") from None
        # Every adapter config this LoraConfig can produce is validated now (AdapterConfig
        # names the field), before any module is touched.
        for r in [self.r, *self.rank_pattern.values()]:
            for alpha in [self.lora_alpha, *self.alpha_pattern.values()]:
                self._adapter_config(r, alpha)

    @property
    def peft_type(self) -> str:
        """PEFT's name of this config's method: "PREFIX_TUNING" or "LORA"."""
        return "PREFIX_TUNING" if self.num_virtual_tokens else "LORA"

    def _adapter_config(self, r, alpha) -> AdapterConfig:
        try:
            return AdapterConfig(rank=r, alpha=alpha, dropout=self.lora_dropout,
                                 use_rslora=self.use_rslora,
                                 init_lora_weights=self.init_lora_weights, dtype=self.dtype,
                                 use_dora=self.use_dora)
        except ValueError as e:
            msg = str(e).replace("AdapterConfig.rank", "LoraConfig.r").replace(
                "AdapterConfig.alpha", "LoraConfig.lora_alpha").replace(
                "AdapterConfig.dropout", "LoraConfig.lora_dropout").replace(
                "AdapterConfig.", "LoraConfig.")
            raise ValueError(msg) from None

    def adapter_config(self, name: str) -> AdapterConfig:
        """The AdapterConfig of the adapter with global name `name`."""
        r = next((v for p, v in self.rank_pattern.items() if re.search(p, name)), self.r)
        alpha = next((v for p, v in self.alpha_pattern.items() if re.search(p, name)),
                     self.lora_alpha)
        return self._adapter_config(r, alpha)

    def to_dict(self) -> dict:
        """Plain data (for checkpoints and adapter_config.json)."""
        return {
            "r": self.r, "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout,
            "target_modules": list(self.target_modules), "use_rslora": self.use_rslora,
            "init_lora_weights": self.init_lora_weights, "rank_pattern": dict(self.rank_pattern),
            "alpha_pattern": dict(self.alpha_pattern), "seed": self.seed,
            "dtype": None if self.dtype is None else str(self.dtype).replace("torch.", ""),
            **({"use_dora": True} if self.use_dora else {}),
            **({"trainable_token_indices": list(self.trainable_token_indices)}
               if self.trainable_token_indices else {}),
            **({"num_virtual_tokens": self.num_virtual_tokens,
                "prefix_projection": self.prefix_projection,
                "encoder_hidden_size": self.encoder_hidden_size}
               if self.num_virtual_tokens else {}),
        }


# --lora-dtype names (and the names LoraConfig.to_dict() writes) -> torch dtype.
LORA_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
               "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def lora_dtype(value) -> Optional[torch.dtype]:
    """LoraConfig.dtype as a torch dtype (None stays None: the base weight's dtype); a name or
    dtype outside fp32 / bf16 / fp16 is a ValueError naming the field and the flag."""
    if value is None or (isinstance(value, torch.dtype) and value in LORA_DTYPES.values()):
        return value
    if isinstance(value, str) and value in LORA_DTYPES:
        return LORA_DTYPES[value]
    raise ValueError(f"LoraConfig.dtype (--lora-dtype) must be fp32, bf16 or fp16 (or None: the "
                     f"base weight's dtype), got {value!r}")


def dtype_name(dtype: Optional[torch.dtype]) -> Optional[str]:
    """torch.bfloat16 -> "bf16" (the --lora-dtype spelling); None -> None."""
    return None if dtype is None else {torch.float32: "fp32", torch.bfloat16: "bf16",
                                       torch.float16: "fp16"}[dtype]


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _sites(model) -> List[Tuple[str, str, torch.nn.Module, str]]:
    """(kind, global name, parent module, attribute) for every LoRA-able module on this rank."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    sites = []
    embedding = getattr(model, "embedding", None)
    if embedding is not None:
        sites.append(("embedding", "embedding", embedding, "word_embeddings"))
    decoder = getattr(model, "decoder", None)
    for layer in getattr(decoder, "layers", []):
        prefix = global_layer_prefix(layer)
        attn = layer.self_attention
        for attr in ATTENTION_INPUTS:  # q/k/v fused, or multi-latent attention's projections
            if getattr(attn, attr, None) is not None:
                sites.append(("linear_qkv", f"{prefix}.self_attention.{attr}", attn, attr))
        sites.append(("linear_proj", f"{prefix}.self_attention.linear_proj", attn, "linear_proj"))
        mlp = layer.mlp
        if isinstance(mlp, MoELayer):
            sites.append(("router", f"{prefix}.mlp.router", mlp, "router"))
            for kind in ("linear_fc1", "linear_fc2"):
                sites.append((kind, f"{prefix}.mlp.experts", mlp, "experts"))
            shared = getattr(mlp, "shared_experts", None)
            if shared is not None:  # a dense MLP beside the routed experts: its own adapters
                for kind in ("linear_fc1", "linear_fc2"):
                    sites.append((kind, f"{prefix}.mlp.shared_experts.{kind}", shared, kind))
        else:
            sites.append(("linear_fc1", f"{prefix}.mlp.linear_fc1", mlp, "linear_fc1"))
            sites.append(("linear_fc2", f"{prefix}.mlp.linear_fc2", mlp, "linear_fc2"))
    if getattr(model, "output_layer", None) is not None and getattr(model, "post_process", False):
        sites.append(("output_layer", "output_layer", model, "output_layer"))
    return sites


def validate_for_model(model, config: LoraConfig) -> None:
    """Every problem of `config` for `model`, raised identically on every rank (no collective):
    targets the model does not have, ranks larger than a targeted weight allows."""
    m = _unwrap(model)
    tconf = m.config
    available = model_kinds(tconf)
    missing = [k for k in config.target_modules if k not in available]
    if missing:
        raise UnknownTargetError(
            f"LoRA targets {missing} do not exist in this model; its targets are "
            f"{', '.join(available)}"
        )
    problems = []
    if {"linear_fc1", "linear_fc2"} & set(config.target_modules) and tconf.num_moe_experts:
        from megatron.core.transformer.moe.experts import SequentialMLP

        for layer in getattr(getattr(m, "decoder", None), "layers", []):
            experts = getattr(layer.mlp, "experts", None)  # None: a dense layer's MLP
            if experts is not None and not isinstance(experts, SequentialMLP):
                problems.append(
                    f"expert LoRA (linear_fc1/linear_fc2) needs SequentialMLP experts; this model "
                    f"has {type(experts).__name__} (build it with moe_grouped_gemm=False)"
                )
                break
    if config.num_virtual_tokens:
        problems += prefix_problems(m, config)
    else:
        problems += config_problems(config, tconf, m.vocab_size)
    problems += model_token_problems(m, config.trainable_token_indices)
    if problems:
        raise ValueError("; ".join(problems))


def apply_lora(model, config: LoraConfig, *, verbose: bool = True) -> Dict[str, torch.nn.Module]:
    """Wrap every targeted module of `model` (this rank's pipeline stage) in place with a LoRA
    adapter, freeze everything else, and print PEFT's trainable-parameter line on rank 0.

    Returns {global name: adapter module}. Collective at the end (the parameter count), so call
    it on every rank; all validation happens before any module is changed.
    """
    m = _unwrap(model)
    validate_for_model(m, config)
    for p in m.parameters():
        p.requires_grad_(False)
    adapters: Dict[str, torch.nn.Module] = {}
    seed_for = functools.partial(adapter_seed, config.seed)
    sites = _sites(m)
    expert_targets: Dict[int, List[str]] = {}
    for kind, name, parent, attr in sites:
        if attr == "experts" and kind in config.target_modules:
            expert_targets.setdefault(id(parent), []).append(kind)
    for kind, name, parent, attr in sites:
        if kind not in config.target_modules:
            continue
        if attr == "experts":
            targets = expert_targets.pop(id(parent), None)
            if targets is None:  # both fc1 and fc2 of this layer were wrapped together
                continue
            for adapter in wrap_experts(parent.experts, config.adapter_config, prefix=name,
                                        seed_for=seed_for, targets=targets, moe_layer=parent):
                adapters[f"{name}.{adapter.kind}"] = adapter  # every local expert's, stacked
            route = getattr(parent.experts, "token_route", None)
            if route is not None:  # one key per MoE layer forward, sub-keyed per expert
                route.stream = dropout_stream(name)
        elif kind == "router":
            adapters[name] = wrap_router(parent.router, config.adapter_config(name),
                                         seed=seed_for(name))
            adapters[name].dropout_stream = dropout_stream(name)
        else:
            wrap = {"embedding": wrap_embedding, "output_layer": wrap_output_layer}.get(
                kind, LoraAdapter)
            adapter = wrap(getattr(parent, attr), config.adapter_config(name), seed=seed_for(name))
            if isinstance(adapter, LoraAdapter):
                adapter.dropout_stream = dropout_stream(name)
            setattr(parent, attr, adapter)
            adapters[name] = adapter
    if config.trainable_token_indices:
        adapters.update(wrap_model_tokens(m, config.trainable_token_indices, config.dtype))
    if config.num_virtual_tokens:
        adapters.update(apply_prefix(m, config))
    trainable, total = count_parameters(m)
    if verbose and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"trainable params: {trainable:,d} || all params: {total:,d} || "
              f"trainable%: {100.0 * trainable / max(total, 1):.4f}")
    return adapters


def _is_expert(p) -> bool:
    return not getattr(p, "allreduce", True)


def count_parameters(model) -> Tuple[int, int]:
    """(trainable, all) parameters of the GLOBAL model, counting each global element once.

    TP-sharded and expert parameters are summed over the ranks that hold distinct parts; replicas
    (over DP, over TP for replicated tensors) are counted once. Collective over model-parallel
    groups.
    """
    from megatron.core import parallel_state as ps

    counts = [0, 0, 0, 0]  # dense trainable, dense all, expert trainable, expert all
    tp_rank = ps.get_tensor_model_parallel_rank()
    etp_rank = ps.get_expert_tensor_parallel_rank()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    for p in _unwrap(model).parameters():
        expert = _is_expert(p)
        sharded = getattr(p, "tensor_model_parallel", False)
        if not sharded and (etp_rank if expert else tp_rank) != 0:
            continue  # a TP replica: counted on TP rank 0
        if getattr(p, PREFIX_SHARED, False) and pp_rank != 0:
            continue  # prefix tuning's projection, held by every stage: counted on the first
        base = 2 if expert else 0
        counts[base + 1] += p.numel()
        if p.requires_grad:
            counts[base] += p.numel()
    for module in _unwrap(model).modules():
        # A frozen weight held in NF4 (models/nf4_linear.py) is buffers, no Parameter: count the
        # elements it stands for (2 codes per byte), with its weight's sharding attributes.
        codes = getattr(module, "nf4_codes", None)
        if codes is None:
            continue
        kept = getattr(module, "nf4_weight_attributes", {})
        expert = kept.get("allreduce", True) is False
        if not kept.get("tensor_model_parallel", False) and \
                (etp_rank if expert else tp_rank) != 0:
            continue
        counts[(2 if expert else 0) + 1] += codes.numel() * 2
    if dist.is_initialized():  # on the rank's device: the groups are NCCL's on a GPU
        here = dict(dtype=torch.float64, device=runtime.device())  # exact below 2^53
        dense, expert = torch.tensor(counts[:2], **here), torch.tensor(counts[2:], **here)
        dist.all_reduce(dense, group=ps.get_model_parallel_group())
        dist.all_reduce(expert, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        counts = torch.cat([dense, expert]).tolist()  # one host read, at setup
    return int(counts[0] + counts[2]), int(counts[1] + counts[3])


ADAPTER_TYPES = (LoraAdapter, ExpertLora, RouterLora, EmbeddingLora)


def lora_modules(model) -> List[torch.nn.Module]:
    """Every adapter module of this rank's model (linear, expert, router, embedding)."""
    return [mod for mod in _unwrap(model).modules() if isinstance(mod, ADAPTER_TYPES)]


def get_adapter_params(model) -> Dict[str, torch.nn.Parameter]:
    """{local name: parameter} of every LoRA factor of this rank's model."""
    return {n: p for n, p in _unwrap(model).named_parameters()
            if n.endswith("lora_A") or n.endswith("lora_B") or ".lora_" in n
            or n.endswith(TOKENS_DELTA) or n.rsplit(".", 1)[-1].startswith("prefix_")
            or n.startswith(f"{PREFIX_ENCODER}.")}


def set_trainable_params(model, names) -> None:
    """requires_grad=True exactly for the parameters named in `names` (local names)."""
    names = set(names)
    for n, p in _unwrap(model).named_parameters():
        p.requires_grad_(n in names)


def adapter_state_dict(model) -> Dict[str, torch.Tensor]:
    """This rank's adapter factors (detached), keyed by local parameter name."""
    return {n: p.detach() for n, p in get_adapter_params(model).items()}


def merge_adapters(model, safe: bool = False) -> None:
    """Merge every adapter into its base weight shard (safe: linear adapters check for non-finite
    values on every rank first and leave the base untouched on failure)."""
    for adapter in lora_modules(model):
        if isinstance(adapter, (LoraAdapter, ExpertLora)):
            adapter.merge(safe=safe)
        else:
            adapter.merge()


def unmerge_adapters(model) -> None:
    for adapter in lora_modules(model):
        adapter.unmerge()
