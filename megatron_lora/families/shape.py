"""The sizes that define a decoder-only MoE model, in megatron-core's names (pure data).

`ModelShape` is what every layer of megatron_lora reads about a model's sizes: the builder turns it
into a TransformerConfig (models/gpt.py), conversion into tensor shapes, the LoRA checks into adapter
shapes. The vocabulary is padded to a multiple of `VOCAB_MULTIPLE` (128) rows, the same for every
layout, so one checkpoint loads at any TP that divides the padded vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

VOCAB_MULTIPLE = 128
# multi-latent attention's input projections (megatron's module names; MlaShape.linear_shapes)
MLA_INPUTS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
              "linear_kv_up_proj")


@dataclass(frozen=True)
class YarnRope:
    """YaRN-scaled RoPE as transformers 5.24 computes it (`_compute_yarn_parameters`), in its
    config's names (families/common.py `read_yarn` reads them from config.json).

    Per frequency i of a head of d rotary channels (base b): the extrapolated frequency
    b^(-2i/d) and the interpolated one b^(-2i/d) / factor are blended by a ramp over i that is 0
    below `low` and 1 above `high`, the dimensions where a wavelength turns `beta_fast` and
    `beta_slow` times over `original_max_position_embeddings` positions (floored / ceiled when
    `truncate`); cos and sin are then multiplied by `attention_factor`, so every q.k logit is
    scaled by its square.
    mscale / mscale_all_dim: with both non-zero the attention factor is
    get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) (DeepSeek-V3's configs);
    otherwise get_mscale(factor) = 0.1 ln(factor) + 1 (1 for factor <= 1).
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None

    @staticmethod
    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    @property
    def uses_mscale_ratio(self) -> bool:
        """Whether the attention factor is the mscale ratio (both fields non-zero)."""
        return bool(self.mscale and self.mscale_all_dim)

    @property
    def attention_factor(self) -> float:
        """The factor cos and sin are multiplied by (transformers' `attention_scaling`)."""
        if self.uses_mscale_ratio:
            return float(self.get_mscale(self.factor, self.mscale)
                         / self.get_mscale(self.factor, self.mscale_all_dim))
        return self.get_mscale(self.factor)


@dataclass(frozen=True)
class MlaShape:
    """Multi-latent attention sizes (DeepSeek-V2/V3; megatron's MLATransformerConfig names, HF's
    in brackets).

    q_lora_rank: the query's latent width (q_a_proj's rows); None: one q projection from the
        hidden state (DeepSeek-V2-Lite's q_proj).
    kv_lora_rank: the key/value latent width (kv_a_proj_with_mqa's first rows).
    qk_head_dim: per head, the query/key channels without rope (qk_nope_head_dim).
    qk_pos_emb_head_dim: per head, the rope channels (qk_rope_head_dim), one key part shared by
        every head.
    v_head_dim: per head, the value channels (may differ from qk_head_dim + qk_pos_emb_head_dim).
    rope_interleaved: the checkpoint's rope channels rotate adjacent pairs (HF rope_interleave,
        DeepSeek's own layout); False: rotate-half order, permuted on conversion (models/mla.py).
    """

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int
    rope_interleaved: bool = True

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"MlaShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"MlaShape.q_lora_rank must be >= 1 or None, got {self.q_lora_rank}")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"MlaShape.qk_pos_emb_head_dim must be even (rope rotates pairs), "
                             f"got {self.qk_pos_emb_head_dim}")

    @property
    def q_head_dim(self) -> int:
        """Channels per query/key head (nope + rope)."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    def linear_shapes(self, hidden: int, heads: int) -> Dict[str, Tuple[int, int]]:
        """{megatron name: (in_features, out_features)} of one layer's attention linears, global
        (models/mla.py has their tensor table): linear_q_down_proj (h -> q_lora_rank) and
        linear_q_up_proj (q_lora_rank -> n (nope + rope)), or linear_q_proj (h -> n (nope +
        rope)) without q_lora_rank; linear_kv_down_proj (h -> kv_lora_rank + rope),
        linear_kv_up_proj (kv_lora_rank -> n (nope + v)), linear_proj (n v -> h)."""
        out = {}
        if self.q_lora_rank:
            out["linear_q_down_proj"] = (hidden, self.q_lora_rank)
            out["linear_q_up_proj"] = (self.q_lora_rank, heads * self.q_head_dim)
        else:
            out["linear_q_proj"] = (hidden, heads * self.q_head_dim)
        out["linear_kv_down_proj"] = (hidden, self.kv_lora_rank + self.qk_pos_emb_head_dim)
        out["linear_kv_up_proj"] = (self.kv_lora_rank, heads * (self.qk_head_dim + self.v_head_dim))
        out["linear_proj"] = (heads * self.v_head_dim, hidden)
        return out


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """Smallest multiple of `multiple` that is >= vocab_size (layout independent)."""
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder (names as in megatron-core).

    kv_channels: the attention head dimension; None means hidden_size / num_attention_heads
    (then hidden_size must be a multiple of the head count).
    qk_layernorm: an RMSNorm over each query and key head ([d] weights) before RoPE.
    qk_norm_full_width: with qk_layernorm, the query and key norms run over the whole projection
    instead (OLMoE: one RMS over all n*d query channels, weight [n*d]; keys [g*d]).
    moe_router_pre_softmax: the routing weights are the softmax over all experts taken at the
    top-k (not renormalised: HF `norm_topk_prob: false`); False renormalises over the top-k.
    add_qkv_bias: biases on q, k and v (not on the output projection).
    shared_expert_ffn_hidden_size: a shared expert beside the routed ones (every token, SwiGLU of
    this size; megatron's moe_shared_expert_intermediate_size); None: none.
    shared_expert_gate: the shared expert's output scaled by sigmoid(x . gate) ([1, h] weight).
    moe_layer_pattern: per layer, 1 for an MoE layer and 0 for a dense one (a SwiGLU MLP of
    dense_ffn_hidden_size; megatron's `moe_layer_freq` list); None: every layer is MoE. A model
    with dense layers is stored by megatron-core under per-layer keys (`decoder.layers.{l}.`),
    so None is kept for all-MoE models: their checkpoints stay stacked over layers.
    dense_ffn_hidden_size: the dense layers' FFN size (megatron's ffn_hidden_size; HF
    `intermediate_size`), set exactly when some layer is dense.
    add_bias_linear: biases on every linear (q, k, v, the output projection, the router, each
    expert's fc1 and fc2; GPT-OSS). Experts with biases need expert-TP 1.
    swiglu_alpha / swiglu_limit: GPT-OSS's clamped SwiGLU, gate clamped above at the limit, up to
    +-limit, gate * sigmoid(alpha * gate) * (up + 1); None: SiLU(gate) * up.
    attention_sinks: a learned sink logit per head (megatron's softmax_type="learnable").
    sliding_window / window_layers: layers i with window_layers[i] true attend to the last
    `sliding_window` keys only (HF `layer_types`: "sliding_attention").
    moe_router_score_function: "softmax" or "sigmoid" (the routing weights are the selected
    experts' sigmoid scores, renormalised over the top-k when top-k > 1; GLM-4.5).
    moe_router_expert_bias: a per-expert bias ([E], fp32) added to the scores to choose the
    experts only, never trained nor updated (HF `e_score_correction_bias`).
    moe_router_num_groups / moe_router_group_topk: group-limited routing, the experts chosen
    from the `group_topk` groups with the largest sum of their top-2 scores; None: no groups.
    moe_router_topk_scaling_factor: the routing weights multiplied by it (HF
    `routed_scaling_factor`); None: 1.
    rotary_percent: RoPE on the first rotary_percent of each head's channels (rotate-half, not
    interleaved), the rest passed through (HF `partial_rotary_factor`).
    yarn: YaRN-scaled RoPE over the whole head (megatron's position_embedding_type "yarn",
    models/gpt.py; with `mla`, over the rope channels); None: plain RoPE of `rotary_base`.
    mla: multi-latent attention (MlaShape) instead of grouped-query attention: then
    num_query_groups equals num_attention_heads, head_dim is the query/key head (nope + rope),
    and there are no q/k/v biases nor q/k norms; None: grouped-query attention.
    """

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    num_experts: Optional[int] = None
    moe_router_topk: int = 2
    max_position_embeddings: int = 4096
    rotary_base: float = 1e6
    norm_epsilon: float = 1e-5
    tie_embeddings: bool = False
    kv_channels: Optional[int] = None
    qk_layernorm: bool = False
    qk_norm_full_width: bool = False
    moe_router_pre_softmax: bool = False
    add_qkv_bias: bool = False
    shared_expert_ffn_hidden_size: Optional[int] = None
    shared_expert_gate: bool = False
    moe_layer_pattern: Optional[Tuple[int, ...]] = None
    dense_ffn_hidden_size: Optional[int] = None
    add_bias_linear: bool = False
    swiglu_alpha: Optional[float] = None
    swiglu_limit: Optional[float] = None
    attention_sinks: bool = False
    sliding_window: Optional[int] = None
    window_layers: Optional[Tuple[bool, ...]] = None
    moe_router_score_function: str = "softmax"
    moe_router_expert_bias: bool = False
    moe_router_num_groups: Optional[int] = None
    moe_router_group_topk: Optional[int] = None
    moe_router_topk_scaling_factor: Optional[float] = None
    rotary_percent: float = 1.0
    yarn: Optional[YarnRope] = None
    mla: Optional[MlaShape] = None

    def __post_init__(self):
        positive = ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers",
                    "num_attention_heads", "num_query_groups", "max_position_embeddings")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_channels is not None and self.kv_channels < 1:
            raise ValueError(f"ModelShape.kv_channels must be >= 1, got {self.kv_channels}")
        if self.kv_channels is None and self.mla is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"ModelShape.hidden_size={self.hidden_size} is not a multiple of "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"ModelShape.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        if self.qk_norm_full_width and not self.qk_layernorm:
            raise ValueError("ModelShape.qk_norm_full_width needs qk_layernorm")
        if self.num_experts is not None and not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(
                f"ModelShape.moe_router_topk={self.moe_router_topk} must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if isinstance(self.yarn, dict):  # asdict() read back
            object.__setattr__(self, "yarn", YarnRope(**self.yarn))
        if isinstance(self.mla, dict):
            object.__setattr__(self, "mla", MlaShape(**self.mla))
        if self.mla is not None:
            self._check_mla()
        if self.yarn is not None and self.rotary_percent != 1.0:
            # megatron's YarnRotaryEmbedding rotates the whole head (it ignores rotary_percent)
            raise ValueError("ModelShape.yarn needs rotary_percent 1 (YaRN on part of each head "
                             "is not supported)")
        if (self.swiglu_limit is not None) != (self.swiglu_alpha is not None):
            raise ValueError("ModelShape.swiglu_alpha and swiglu_limit go together (GPT-OSS's "
                             "clamped SwiGLU)")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelShape.sliding_window must be >= 1, got {self.sliding_window}")
        if self.window_layers is not None:  # a JSON list read back: one bool per layer
            object.__setattr__(self, "window_layers", tuple(bool(w) for w in self.window_layers))
        if self.window_layers is not None and (self.sliding_window is None
                                               or len(self.window_layers) != self.num_layers):
            raise ValueError(
                f"ModelShape.window_layers needs sliding_window and one entry per layer "
                f"({self.num_layers}), got {self.window_layers!r}"
            )
        self._check_layer_pattern()

    def _check_mla(self) -> None:
        if self.num_query_groups != self.num_attention_heads:
            raise ValueError(f"ModelShape.mla needs num_query_groups == num_attention_heads "
                             f"({self.num_attention_heads}), got {self.num_query_groups}")
        clashes = [name for name in ("qk_layernorm", "add_qkv_bias", "add_bias_linear",
                                     "attention_sinks") if getattr(self, name)]
        if clashes or self.rotary_percent != 1.0 or self.sliding_window is not None:
            what = ", ".join(clashes) or "partial rotary or a sliding window"
            raise ValueError(f"ModelShape.mla does not go with {what} (multi-latent attention "
                             f"has none of them)")
        if self.kv_channels not in (None, self.mla.q_head_dim):
            raise ValueError(f"ModelShape.kv_channels with mla must be None or "
                             f"qk_head_dim + qk_pos_emb_head_dim = {self.mla.q_head_dim}")

    def _check_layer_pattern(self) -> None:
        pattern = self.moe_layer_pattern
        if pattern is None:
            if self.dense_ffn_hidden_size is not None:
                raise ValueError("ModelShape.dense_ffn_hidden_size needs dense layers "
                                 "(moe_layer_pattern with a 0)")
            return
        if len(pattern) != self.num_layers or set(pattern) - {0, 1}:
            raise ValueError(f"ModelShape.moe_layer_pattern must be {self.num_layers} values of "
                             f"0 (dense) or 1 (MoE), got {list(pattern)}")
        if 0 not in pattern:
            raise ValueError("ModelShape.moe_layer_pattern without a dense layer: use None")
        if 1 not in pattern or not self.num_experts:
            raise ValueError("ModelShape.moe_layer_pattern has no MoE layer (a dense model)")
        if self.dense_ffn_hidden_size is None or self.dense_ffn_hidden_size < 1:
            raise ValueError(f"ModelShape.dense_ffn_hidden_size must be >= 1 with dense layers, "
                             f"got {self.dense_ffn_hidden_size}")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer `layer` is an MoE layer (else a dense MLP)."""
        return self.moe_layer_pattern is None or bool(self.moe_layer_pattern[layer])

    @property
    def per_layer_keys(self) -> bool:
        """megatron-core keys this model's layers per layer (`decoder.layers.{l}.`), not stacked
        on a leading layer axis: it does so for any `moe_layer_freq` list."""
        return self.moe_layer_pattern is not None

    @property
    def head_dim(self) -> int:
        """Channels per attention head (megatron's kv_channels); with mla, per query/key head."""
        if self.mla is not None:
            return self.mla.q_head_dim
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def qk_norm_widths(self) -> tuple:
        """Channels of the query and key norm weights: (d, d) per head, (n*d, g*d) full width."""
        if self.qk_norm_full_width:
            return (self.num_attention_heads * self.head_dim,
                    self.num_query_groups * self.head_dim)
        return (self.head_dim, self.head_dim)

    def layout_sizes(self) -> dict:
        """The sizes ParallelLayout.validate checks against."""
        return dict(
            num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            num_experts=self.num_experts or 0,
            ffn_hidden_size=None if self.num_experts else self.ffn_hidden_size,
            moe_ffn_hidden_size=self.ffn_hidden_size if self.num_experts else None,
            expert_biases=bool(self.num_experts and self.add_bias_linear),
        ) | ({"ffn_hidden_size": self.dense_ffn_hidden_size} if self.dense_ffn_hidden_size else {})


def moe_layer_pattern(moe_layer_freq, num_layers: int, num_experts) -> list:
    """Per global layer 1 (MoE) or 0 (dense) as megatron-core reads TransformerConfig's
    `moe_layer_freq`: an int f makes layer l MoE iff l % f == 0, a list is the pattern itself;
    all 0 without experts."""
    if not num_experts:
        return [0] * num_layers
    if isinstance(moe_layer_freq, int):
        return [int(l % moe_layer_freq == 0) for l in range(num_layers)]
    return [int(x) for x in moe_layer_freq]


def tiny_moe_shape(**overrides) -> ModelShape:
    """An MoE model small enough for multi-rank CPU tests (GQA, 4 experts, top-2)."""
    base = dict(
        vocab_size=256, hidden_size=64, ffn_hidden_size=96, num_layers=4,
        num_attention_heads=4, num_query_groups=2, num_experts=4, moe_router_topk=2,
        max_position_embeddings=128, rotary_base=1e6, norm_epsilon=1e-5,
    )
    base.update(overrides)
    return ModelShape(**base)
