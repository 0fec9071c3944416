"""Exact attention through torch's fused `scaled_dot_product_attention` (SDPA), for the local spec.

`SDPAttention` is a drop-in `core_attention` for megatron-core's SelfAttention: same constructor
and forward as megatron's `DotProductAttention`, same result in fp32 (to rounding), but it never
keeps the `[b, heads, s, s]` attention probabilities for backward. Megatron's unfused
DotProductAttention materialises scores and probabilities of that shape (memory quadratic in s);
the fused kernels keep only the output and a per-row log-sum-exp (linear in s) and recompute the
probabilities block by block in backward.

Which kernel runs where (torch picks among the kernels allowed by the arguments we pass):

| case | what we pass | CPU (torch 2.13) | CUDA GPU |
|---|---|---|---|
| causal, no mask (unpacked batches) | `is_causal=True`, no mask tensor, `enable_gqa=True` | fused flash kernel (`_scaled_dot_product_flash_attention_for_cpu`) | flash kernel (memory-efficient kernel when flash does not apply, e.g. head_dim > 256) |
| packed samples (`attention_mask` [b, 1, s, s]) | additive float `attn_mask` (0 / -inf), k/v expanded over the query groups | the same fused flash kernel, which takes the mask | memory-efficient kernel (flash takes no mask) |

Memory kept for backward besides q, k, v and the output: causal: the [b, heads, s] log-sum-exp;
packed: that, k/v expanded to [b, heads, s, d], and one additive mask [b, 1, s, s] in the
activation dtype (4 bytes per element in fp32) made once from the boolean mask and shared by
every head and every layer of the micro-batch (it is cached on the mask tensor). Given the
boolean mask itself, torch would convert it to such a float mask inside every call and keep one
copy per layer; DotProductAttention keeps [b, heads, s, s] scores and probabilities per layer.
How packed samples are represented: megatron_lora.data.packing builds a block-diagonal causal
mask [b, 1, s, s] (True = masked, megatron's convention) that training.step passes to the model
as `attention_mask`; `packed_seq_params` (cu_seqlens, TE's THD format) is not used by this project
and is refused here, as megatron's DotProductAttention refuses it.

Value heads of another size than the query/key heads (multi-latent attention, models/mla.py,
passes `k_channels` / `v_channels`) are zero-padded with the query/key heads to the larger size:
with unequal sizes torch runs its math kernel, which keeps [b, heads, s, s]; the zero channels
add nothing to the scores and the padded value channels are cut from the output.

Learned sinks (`softmax_type="learnable"`, GPT-OSS; also "off-by-one", a sink fixed at 0) and
causal sliding windows (`window_size=(W - 1, 0)` on the layers `window_attn_skip_freq` picks) run
on the same fused kernels through models/sink_window.py: the sink is one more key per head, the
window one shared additive mask (combined with a packed mask, so each sample keeps its own window
and sink). The sinks are a base parameter, `softmax_offset` [heads on this TP rank]
(frozen with the other base weights under LoRA), checkpointed as megatron's DotProductAttention checkpoints it (sharded over TP on dim 0).

Refused at construction, with the setting to change: attention dropout > 0 (SDPA draws its own
dropout mask, outside megatron's RNG tracker, so results could not match DotProductAttention's),
windows other than causal ones, qk-clip and context parallelism.

Parallel state: runs on this TP rank's heads (num_attention_heads / tp query heads,
num_query_groups / tp key/value groups); sequence parallelism does not reach here (SelfAttention
gathers the sequence before linear_qkv), so s is always the full sequence.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_lora import runtime
from megatron_lora.lora.prefix import register_prefix_core_attention
from megatron_lora.models import sink_window


def _additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[b, 1, s, s] float mask (0 where attending, -inf where megatron's boolean mask is True),
    made once per mask tensor and dtype: every layer of a micro-batch gets the same mask object,
    so they share one copy (saved for backward by each layer, stored once)."""
    key = (dtype, mask.device, mask._version)
    cached = getattr(mask, "_sdpa_additive_mask", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    additive.masked_fill_(mask, float("-inf"))
    mask._sdpa_additive_mask = (key, additive)
    return additive


def _refuse(config: TransformerConfig, attention_dropout: Optional[float]) -> None:
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    if dropout:
        raise ValueError(
            f"SDPAttention (attention backend 'flash'/'auto') needs attention_dropout=0, got "
            f"{dropout}: torch's fused kernels draw their own dropout mask, so the result would "
            "not match megatron's DotProductAttention; use --attention-backend unfused for "
            "attention dropout"
        )
    problems = []
    if getattr(config, "softmax_type", "vanilla") not in ("vanilla", "off-by-one", "learnable"):
        problems.append(f"softmax_type={config.softmax_type!r}")
    window = sink_window.window_problem(getattr(config, "window_size", None))
    if window:
        problems.append(window)
    if getattr(config, "qk_clip", False):
        problems.append("qk_clip=True (no attention-logit statistics)")
    if config.context_parallel_size != 1:
        problems.append(f"context_parallel_size={config.context_parallel_size} (only 1)")
    if problems:
        raise ValueError(
            "SDPAttention (attention backend 'flash'/'auto') does not support "
            + "; ".join(problems) + "; use --attention-backend unfused"
        )


@register_prefix_core_attention
class SDPAttention(MegatronModule):
    """core_attention computing softmax(q k^T * scale + mask) v with torch's fused SDPA.

    forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
    packed_seq_params=None):
      query/key [sq|sk, b, np|ng, hn], value [sk, b, ng, hv] (np = heads, ng = query groups on
      this TP rank; hn = hv = kv_channels, or k_channels / v_channels as multi-latent attention
      passes them); attention_mask None (causal by attn_mask_type) or bool [b or 1, 1, sq, sk] with
      True = masked out (megatron's convention; it then replaces the causal mask, as in
      DotProductAttention). With a KV cache, sk may exceed sq: the queries are then the last sq
      positions (causal up to each one). Returns the context [sq, b, np * hv].
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        **kwargs,  # pg_collection and whatever later releases pass: only the TP size is needed
    ):
        super().__init__(config=config)
        _refuse(config, attention_dropout)
        self.config = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        pg_collection = kwargs.get("pg_collection")
        if pg_collection is not None and hasattr(pg_collection, "tp"):
            self.tp_group = pg_collection.tp
            tp = pg_collection.tp.size()
        else:
            from megatron.core import parallel_state

            self.tp_group = None  # parallel_state's, read when a checkpoint needs it
            tp = parallel_state.get_tensor_model_parallel_world_size()
        if config.num_attention_heads % tp or config.num_query_groups % tp:
            raise ValueError(
                f"num_attention_heads={config.num_attention_heads} and num_query_groups="
                f"{config.num_query_groups} must both divide by the tensor-parallel size {tp}"
            )
        self.heads_per_partition = config.num_attention_heads // tp
        self.groups_per_partition = config.num_query_groups // tp
        # Multi-latent attention (models/mla.py) passes its query/key head size (qk_head_dim +
        # qk_pos_emb_head_dim) and its value head size (v_head_dim), which may differ.
        self.head_dim = config.kv_channels if k_channels is None else k_channels
        self.v_head_dim = config.kv_channels if v_channels is None else v_channels
        # DotProductAttention divides by layer_number under apply_query_key_layer_scaling and
        # multiplies the scores back in its softmax: the net scale is this one.
        self.softmax_scale = (
            1.0 / math.sqrt(self.head_dim) if softmax_scale is None else softmax_scale
        )
        self.window = sink_window.layer_window(config, self.layer_number)
        self.softmax_type = getattr(config, "softmax_type", "vanilla")
        self.softmax_offset = None
        if self.softmax_type == "learnable":
            # megatron's DotProductAttention's parameter (name, shape, init, checkpoint key).
            self.softmax_offset = torch.nn.Parameter(
                torch.empty(self.heads_per_partition, dtype=config.params_dtype,
                            device=runtime.device()))
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
            for name, value in (("tensor_model_parallel", True), ("partition_dim", 0),
                                ("partition_stride", 1)):
                setattr(self.softmax_offset, name, value)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError(
                "SDPAttention takes packed samples as a block-diagonal attention_mask "
                "[b, 1, s, s] (megatron_lora.data.packing), not packed_seq_params"
            )
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention_bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, b, np_, hn = query.shape
        sk = key.shape[0]
        # [s, b, n, d] -> [b, n, s, d]: a view; the kernels take any strides with a unit last one.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        hv = value.shape[-1]
        if hv != hn:
            # The fused kernels want one head size for q, k and v (with another v size torch
            # falls back to its math kernel, which keeps [b, heads, s, s]): zero channels pad the
            # narrower side; they add nothing to the scores, and padded value channels are cut
            # from the output.
            width = max(hn, hv)
            q, k = (F.pad(t, (0, width - hn)) for t in (q, k))
            v = F.pad(v, (0, width - hv))
        rep = np_ // key.shape[2]
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            raise ValueError(
                f"SDPAttention expects a boolean attention_mask (True = masked), got "
                f"{attention_mask.dtype}"
            )
        if self.softmax_type != "vanilla" or self.window is not None:
            out = self._sink_window(q, k, v, attention_mask, mask_type, rep)
        elif attention_mask is not None:
            if rep > 1:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            # Packed samples: every row keeps at least its diagonal (packing guarantees it), so
            # no row is fully masked; megatron fills masked scores with -10000, which is exactly
            # zero probability in fp32, as -inf is.
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=_additive_mask(attention_mask, q.dtype),
                scale=self.softmax_scale,
            )
        elif self.attn_mask_type == AttnMaskType.causal and 1 < sq < sk:
            # A KV-cache step of several tokens (megatron_lora.inference): the queries are the
            # last sq of the sk positions, so query i sees keys 0 .. sk - sq + i. Megatron passes
            # no_mask past the prompt, which is right only for one token at a time.
            if rep > 1:
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=self.softmax_scale)
        else:
            causal = mask_type == AttnMaskType.causal and sq > 1
            if causal and sq != sk:
                raise ValueError(f"causal attention without a mask needs sq == sk, got {sq}, {sk}")
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=self.softmax_scale, enable_gqa=rep > 1
            )
        # [b, np, sq, hv] -> [sq, b, np * hv]
        return out[..., :hv].permute(2, 0, 1, 3).reshape(sq, b, np_ * hv)

    def _sink_window(self, q, k, v, attention_mask, mask_type, rep):
        """Sinks and/or a sliding window (models/sink_window.py): q, k, v and the result
        [b, np, s, hn] (one head size: forward pads the narrower of q/k and v)."""
        sq, sk, hn = q.shape[2], k.shape[2], q.shape[3]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        sink = self.softmax_type != "vanilla"
        # A KV-cache step of several tokens may come with no_mask (megatron passes it past the
        # prompt); its queries are still the last sq positions of a causal layer.
        causal = (mask_type == AttnMaskType.causal or sq == 1
                  or (self.attn_mask_type == AttnMaskType.causal and sq < sk))
        mask = sink_window.attention_mask(sq, sk, causal, self.window, sink, q.dtype, q.device,
                                          packed=attention_mask)
        if sink:
            sinks = (self.softmax_offset if self.softmax_offset is not None
                     else q.new_zeros(q.shape[1]))
            q, k, v = sink_window.with_sink_key(q, k, v, sinks, self.softmax_scale)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale)
        return out[..., :hn] if sink else out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """DotProductAttention's checkpoint keys: nothing for vanilla and off-by-one softmax,
        `softmax_offset` as this rank's axis-0 slice of the global [heads] for learned sinks."""
        if self.softmax_offset is None:
            return {}
        from megatron.core import parallel_state
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        dp_cp = (metadata or {}).get("dp_cp_group")
        if dp_cp is None:
            dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
        tp_group = self.tp_group or parallel_state.get_tensor_model_parallel_group()
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"softmax_offset": 0},
            sharded_offsets, tp_group=tp_group, dp_cp_group=dp_cp)
