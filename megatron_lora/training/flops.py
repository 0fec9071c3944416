"""Model FLOPs of a LoRA (or full) training step, and the bf16 peaks MFU is measured against.

Megatron-style throughput counts 6 N FLOPs per token (forward, input gradient, weight gradient of
every weight). A LoRA step computes less: the frozen base runs forward and propagates the
activation gradient, but computes no weight gradient. What one step computes, per token of the
step (every position of every row, masked or not: all of them run through the model):

    base linears     2 N forward + 2 N input gradient (+ 2 N weight gradient: full fine-tuning
                     only), N = in x out summed over the linears one token visits: per layer
                     linear_qkv, linear_proj, the router and the top-k experts' linear_fc1 and
                     linear_fc2 (a dense MLP: its fc1 and fc2), plus the output layer h x V; the
                     embedding lookup computes nothing
    attention        QK^T and AV: forward 2 x 2 x (s / 2) x d_attn per layer (causal: a query
                     scores on average s / 2 keys, what a causal kernel computes), backward twice
                     that (gradients of both operands), 6 s d_attn per layer in all; the same
                     for LoRA and full fine-tuning (it has no weights). Multi-latent attention
                     (DeepSeek-V3/V2): QK^T over n heads of nope + rope channels, AV over n
                     heads of v_head_dim, 3 s n (nope + rope + v) per layer (the zero channels
                     SDPAttention pads v with are not model work); its linears are the q/kv
                     down and up projections (or one q projection) and linear_proj (n v x h),
                     `mla_linear_shapes`; LoRA's linear_qkv adapts each of its q/kv projections
    adapters         6 x the adapter parameters a token visits (A and B: forward, activation
                     gradient, weight gradient): 6 r (in + out) per adapted linear (the experts:
                     top-k of them), 6 r h for embedding LoRA (A's row is a lookup), 6 h n for n
                     trainable-token rows (a [h, n] product on the output side; the embedding
                     side replaces rows), 12 n d_attn per layer for n prefix keys and values
                     (never masked), 4 in x out per DoRA linear with dropout (the base runs again
                     on the dropped input, forward and input gradient)
    per forward      weight-sized work once per micro-batch: DoRA's row norms ||W + s B A||
                     (2 out in (r + 1) per DoRA linear, every expert, no backward), the prefix
                     projection (every layer runs the shared E W1 and its own W2, x 3)

Not counted (model FLOPs, not hardware FLOPs): activation recomputation, norms, softmax, RoPE
and other element-wise work, the optimizer. Approximations: a row of packed samples is counted
as one causal sequence (the block-diagonal mask's skipped blocks are not subtracted); the first
layer's input gradients are counted although autograd skips them when nothing before the first
layer is trained; under expert parallelism DoRA's expert norms are counted once per micro-batch
for every expert. See docs/training.md ("Model TFLOP/s and MFU") for a worked example.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import torch

from megatron_lora.families.shape import ModelShape

_EXPERT_KINDS = ("linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class FlopCount:
    """The model FLOPs of one training step, every rank together, by part (see the module
    docstring): `tokens` positions, `micro_batches` model forwards."""

    tokens: int
    micro_batches: int
    base_forward: float
    base_input_grad: float
    base_weight_grad: float
    attention: float
    adapters: float
    per_forward: float

    @property
    def total(self) -> float:
        return sum(self.parts().values())

    @property
    def per_token(self) -> float:
        return self.total / self.tokens

    def parts(self) -> Dict[str, float]:
        """{part: FLOPs of the step}, the fields that add up to `total`."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("tokens", "micro_batches")}


def _global_names(kind: str, sizes) -> list:
    # lora.sizes imports the lora package (megatron's layers): only when adapters are counted,
    # so that tools/memory_estimate.py can read mla_linear_shapes without it
    from megatron_lora.lora.sizes import _global_names as names

    return names(kind, sizes)


def shape_sizes(shape: ModelShape) -> SimpleNamespace:
    """The TransformerConfig size fields megatron_lora.models.gpt.transformer_config sets for
    `shape` (what lora.sizes reads), without building a config."""
    return SimpleNamespace(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.dense_ffn_hidden_size or shape.ffn_hidden_size,
        moe_ffn_hidden_size=shape.ffn_hidden_size,
        num_moe_experts=shape.num_experts, gated_linear_unit=True,
        moe_shared_expert_intermediate_size=shape.shared_expert_ffn_hidden_size,
        moe_layer_freq=list(shape.moe_layer_pattern) if shape.moe_layer_pattern else 1)


def mla_linear_shapes(shape: ModelShape) -> Dict[str, Tuple[int, int]]:
    """{megatron name: (in_features, out_features)} of one multi-latent attention layer's linears
    (families/shape.py MlaShape.linear_shapes)."""
    return shape.mla.linear_shapes(shape.hidden_size, shape.num_attention_heads)


def attention_flops_per_token(shape: ModelShape, seq_len: int) -> int:
    """QK^T and AV of every layer, forward and backward, per token (the module docstring)."""
    n, layers = shape.num_attention_heads, shape.num_layers
    if shape.mla is not None:
        return 3 * seq_len * n * (shape.mla.q_head_dim + shape.mla.v_head_dim) * layers
    return 6 * seq_len * n * shape.head_dim * layers


def _layer_counts(shape: ModelShape) -> Tuple[int, int]:
    """(MoE layers, dense layers between them) of a model with experts."""
    moe = sum(shape.moe_layer_pattern) if shape.moe_layer_pattern else shape.num_layers
    return moe, shape.num_layers - moe


def _in_out(sizes, kind: str, vocab: int) -> Tuple[int, int]:
    from megatron_lora.lora.sizes import _features

    (n_in, _), (n_out, _) = _features(sizes, kind, vocab)
    return n_in, n_out


def active_linear_macs(shape: ModelShape) -> int:
    """N: multiply-accumulates per token of every base linear a token visits (no embedding)."""
    sizes, v = shape_sizes(shape), shape.vocab_size
    if shape.mla is not None:
        per_layer = sum(a * b for a, b in mla_linear_shapes(shape).values())
    else:
        per_layer = sum(a * b for a, b in (_in_out(sizes, k, v) for k in ("linear_qkv",
                                                                            "linear_proj")))
    mlp = sum(a * b for a, b in (_in_out(sizes, k, v) for k in _EXPERT_KINDS))
    if not shape.num_experts:
        return shape.num_layers * (per_layer + mlp) + shape.hidden_size * v
    fs = shape.shared_expert_ffn_hidden_size or 0  # every token: SwiGLU fc1, fc2, its gate
    moe = (shape.hidden_size * shape.num_experts + shape.moe_router_topk * mlp
           + 3 * fs * shape.hidden_size + shape.hidden_size * shape.shared_expert_gate)
    n_moe, n_dense = _layer_counts(shape)
    dense = 3 * (shape.dense_ffn_hidden_size or 0) * shape.hidden_size  # SwiGLU fc1, fc2
    return (shape.num_layers * per_layer + n_moe * moe + n_dense * dense
            + shape.hidden_size * v)


def _kind_rank(lora, sizes, kind: str) -> int:
    # Adapters of one kind share one rank (lora.sizes checks it), so the first name tells.
    return lora.adapter_config(_global_names(kind, sizes)[0]).rank


def _sites(shape: ModelShape, sizes, lora, kind: str) -> List[Tuple[int, int, int]]:
    """(rank, in, out) of each adapter a token passes per layer (or per expert) for `kind`.
    Multi-latent attention: linear_qkv adapts each input projection (q down and up, or q; kv
    down and up), each with its own rank (lora.sizes), linear_proj is n v -> h."""
    if shape.mla is not None and kind in ("linear_qkv", "linear_proj"):
        linears = mla_linear_shapes(shape)
        names = [n for n in linears if (n == "linear_proj") == (kind == "linear_proj")]
        return [(lora.adapter_config(f"decoder.layers.0.self_attention.{n}").rank, *linears[n])
                for n in names]
    return [(_kind_rank(lora, sizes, kind), *_in_out(sizes, kind, shape.vocab_size))]


def _visits(shape: ModelShape, kind: str) -> int:
    """How many adapters of `kind` one token passes through."""
    if kind in ("embedding", "output_layer"):
        return 1
    if kind in _EXPERT_KINDS and shape.num_experts:
        return _layer_counts(shape)[0] * shape.moe_router_topk
    if kind == "router":
        return _layer_counts(shape)[0]
    return shape.num_layers


def _lora_flops(shape: ModelShape, lora) -> Tuple[float, float]:
    """(FLOPs per token, FLOPs per forward) of the LoRA / DoRA adapters and trainable rows."""
    sizes, v, h = shape_sizes(shape), shape.vocab_size, shape.hidden_size
    per_token, per_forward = 0.0, 0.0
    for kind in lora.target_modules:
        sites = _sites(shape, sizes, lora, kind)
        mla_attention = shape.mla is not None and kind in ("linear_qkv", "linear_proj")
        for r, n_in, n_out in sites:
            params = r * h if kind == "embedding" else r * (n_in + n_out)
            per_token += 6 * params * _visits(shape, kind)
            if lora.use_dora:  # every expert's norm, visited or not
                adapters = shape.num_layers if mla_attention else len(_global_names(kind, sizes))
                per_forward += 2 * n_out * n_in * (r + 1) * adapters
                if lora.lora_dropout > 0:
                    per_token += 4 * n_in * n_out * _visits(shape, kind)
        r = sites[0][0]
        fs = shape.shared_expert_ffn_hidden_size
        if kind in _EXPERT_KINDS and shape.num_experts and fs:  # the shared expert's adapters
            rows = 2 * fs if kind == "linear_fc1" else h
            cols = h if kind == "linear_fc1" else fs
            per_token += 6 * r * (rows + cols) * _layer_counts(shape)[0]
        fd = shape.dense_ffn_hidden_size
        if kind in _EXPERT_KINDS and fd:  # the dense layers' MLP adapters
            rows, cols = (2 * fd, h) if kind == "linear_fc1" else (h, fd)
            per_token += 6 * r * (rows + cols) * _layer_counts(shape)[1]
    per_token += 6 * h * len(lora.trainable_token_indices)
    return per_token, per_forward


def _prefix_flops(shape: ModelShape, lora) -> Tuple[float, float]:
    """(FLOPs per token, FLOPs per forward) of prefix tuning's keys, values and projection."""
    if shape.mla is not None:
        raise ValueError("prefix tuning FLOPs: a multi-latent attention model has no per-head "
                         "key/value projection to prefix (not counted)")
    n, layers = lora.num_virtual_tokens, shape.num_layers
    head_dim = shape.head_dim
    per_token = 12 * n * shape.num_attention_heads * shape.head_dim * layers
    per_forward = 0.0
    if lora.prefix_projection:
        td = shape.num_query_groups * head_dim
        enc = lora.encoder_hidden_size or td
        # Every layer calls the shared encoder (E W1) and its own W2: forward, both gradients.
        per_forward = 3 * layers * (2 * n * td * enc + 2 * n * enc * 2 * td)
    return per_token, per_forward


def lora_step_flops(shape: ModelShape, lora_config, seq_len: int, tokens: int, *,
                    micro_batches: Optional[int] = None) -> FlopCount:
    """The model FLOPs of one training step of `tokens` positions in rows of `seq_len`.

    shape: the model's megatron sizes (vocab_size the padded vocabulary the output layer has).
    lora_config: the LoraConfig trained (LoRA, DoRA, trainable tokens or prefix tuning), or None
        for full fine-tuning (every weight trained: 6 N).
    micro_batches: model forwards in the step, all data-parallel ranks together (global batch /
        micro-batch size); None: one per row (the most there can be).
    """
    if seq_len < 1 or tokens < 1:
        raise ValueError(f"lora_step_flops: seq_len and tokens must be >= 1, got {seq_len}, "
                         f"{tokens}")
    micro_batches = micro_batches if micro_batches is not None else -(-tokens // seq_len)
    n = active_linear_macs(shape)
    attention = attention_flops_per_token(shape, seq_len)
    adapters, per_forward = 0.0, 0.0
    if lora_config is not None and lora_config.num_virtual_tokens:
        adapters, per_forward = _prefix_flops(shape, lora_config)
    elif lora_config is not None:
        adapters, per_forward = _lora_flops(shape, lora_config)
    return FlopCount(
        tokens=tokens, micro_batches=micro_batches,
        base_forward=2.0 * n * tokens, base_input_grad=2.0 * n * tokens,
        base_weight_grad=2.0 * n * tokens if lora_config is None else 0.0,
        attention=float(attention) * tokens, adapters=adapters * tokens,
        per_forward=per_forward * micro_batches)


def run_step_flops(shape: ModelShape, lora_config, run) -> FlopCount:
    """lora_step_flops of one iteration of RunConfig `run` (global batch x seq_length
    positions, global batch / micro-batch size forwards)."""
    return lora_step_flops(shape, lora_config, run.seq_length,
                           run.global_batch_size * run.seq_length,
                           micro_batches=run.global_batch_size // run.micro_batch_size)


# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s from NVIDIA's datasheets, by the words
# of torch.cuda.get_device_name(); the first entry whose words all appear wins.
BF16_PEAK_TFLOPS = (
    (("GH200",), 989.0),
    (("H200",), 989.0),
    (("H100", "PCIE"), 756.0),
    (("H100", "NVL"), 835.0),
    (("H100",), 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    (("A100",), 312.0),
    (("L40S",), 362.0),
    (("L4",), 121.0),
    (("A10",), 125.0),
)


def bf16_peak_tflops(device_name: str) -> Optional[float]:
    """The dense bf16 peak of a CUDA device by its name, None when the table lacks it."""
    words = set(re.split(r"[^A-Z0-9]+", device_name.upper()))
    for needed, peak in BF16_PEAK_TFLOPS:
        if all(w in words for w in needed):
            return peak
    return None


def device_peak(device: torch.device, bf16: bool) -> Tuple[Optional[float], str]:
    """(peak TFLOP/s of one device for MFU, or None; what it is or why there is none)."""
    if device.type != "cuda":
        return None, f"no MFU on {device.type} (peaks are known for CUDA devices only)"
    name = torch.cuda.get_device_name(device)
    peak = bf16_peak_tflops(name)
    if peak is None:
        return None, f"no MFU: the bf16 peak of {name!r} is not in megatron_lora.training.flops"
    if not bf16:
        return None, f"no MFU: the run is not bf16 (the peak known for {name!r} is bf16's)"
    return peak, f"MFU against {name}'s dense bf16 peak of {peak:.0f} TFLOP/s per device"


def step_throughput(model_chunks, shape: ModelShape, lora_config,
                    run) -> Tuple[float, Optional[float], str]:
    """What training.loop's log needs: (model FLOPs of one iteration, one device's peak for MFU
    or None, a line saying both). The device and dtype are the first chunk's (its first
    parameter's device, its megatron config's bf16); every rank is taken to have the same."""
    count = run_step_flops(shape, lora_config, run)
    chunk = model_chunks[0]
    param = next(chunk.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    peak, note = device_peak(device, bool(getattr(getattr(chunk, "config", None), "bf16", False)))
    method = "full fine-tuning" if lora_config is None else lora_config.peft_type
    return count.total, peak, (f"model FLOPs per iteration ({method}): {count.total:.4g}, "
                               f"{count.per_token:.4g} per token (docs/training.md); {note}")


__all__ = ["BF16_PEAK_TFLOPS", "FlopCount", "active_linear_macs", "attention_flops_per_token",
           "bf16_peak_tflops", "device_peak", "lora_step_flops", "mla_linear_shapes",
           "run_step_flops", "shape_sizes", "step_throughput"]
