"""Per-GPU memory estimate of LoRA fine-tuning a model of any supported family at a layout.

    python tools/memory_estimate.py --hf-config Mixtral-8x7B-v0.1/config.json \
        --layouts TP2xEP4+SP TP1xEP8 PP2xEP4 TP2xPP2xEP2+SP --world 8 --seq 4096 --rank 16

Counts (bytes per GPU, bf16 model):
  weights     frozen base: dense tensors / TP (/PP by layer), experts / (EP*ETP) (/PP), bf16
              (with GPT-OSS's biases on every linear and its attention sinks);
              dense layers between the MoE layers (first_k_dense_replace, mlp_only_layers) with
              their own MLP, counted on the stage holding the most MoE layers;
              with --base-quantization nf4 the decoder linears (attention, experts, shared
              experts) at NF4's 0.5 + 1/64 + 4/16384 bytes per parameter (4-bit codes, one
              uint8 scale per 64, one fp32 per 256 scales), router, norms, embeddings in bf16;
              a sigmoid router's expert bias (GLM-4.5, DeepSeek-V3): [E] fp32, whole on every
              rank of its stage
              multi-latent attention (DeepSeek-V3/V2, models/mla.py): per layer
              linear_q_down_proj [q_lora_rank, h] and linear_kv_down_proj [kv_lora_rank + rope,
              h] (column-parallel: rows / TP), linear_q_up_proj [n (nope + rope), q_lora_rank]
              (or linear_q_proj [n (nope + rope), h]) and linear_kv_up_proj [n (nope + v),
              kv_lora_rank] (heads / TP), linear_proj [h, n v] (its input / TP), all of them
              NF4 with --base-quantization nf4; the latent norms q_layernorm [q_lora_rank] and
              kv_layernorm [kv_lora_rank] whole on every TP rank
  adapters    LoRA factors held by the GPU, bf16; with multi-latent attention `linear_qkv` in
              the targets stands for all its q/kv projections (down and up), each adapted
  optimizer   per adapter parameter: fp32 main copy + Adam m, v + fp32 grad = 16 bytes
  activations one micro-batch, flash attention (TE; --unfused-attention adds megatron's local
              attention's s x s scores), sequence parallel when TP > 1, no
              recomputation: per layer 2*s*b*h*(5 attention inputs/outputs + 2*k*(1 + 3*f/h)
              expert tokens*k through fc1/act/fc2) / TP, times layers per stage times the 1F1B
              in-flight micro-batches (PP on the first stage)
              multi-latent attention replaces the 5 h of attention by, per token (bf16
              elements, / TP): the layer's input, its norm's output (the attention's input,
              kept by both down projections) and the pre-MLP norm's input (3 h); the q latent
              kept by its norm and the norm's output kept by the up projection (2 q_lora_rank),
              the same for the kv latent (2 kv_lora_rank), and the latent norms' fp32 copies of
              their inputs (2 q_lora_rank + 2 kv_lora_rank); q, k, v and the kernel's output,
              each zero-padded to one head size w = max(nope + rope, v) (4 n w,
              models/attention.py SDPAttention); linear_proj's input (n v). The up projections'
              outputs are not kept (the rope multiplies them by constants); the kernel's
              logsumexp (n fp32), the norms' rms and the rope's cos/sin are left out. On a
              tiny model on CPU this is what autograd keeps, to those small terms
              (tests/tools/test_memory_estimate.py). --unfused-attention is refused (MLA runs
              on SDPAttention only)
              --recompute-granularity full (uniform, 1 layer per chunk): each layer keeps only
              its input [s/TP, b, h] in bf16, plus one layer's full activations while it is
              recomputed in backward; selective (core_attn): the s x s scores of
              --unfused-attention are not kept (flash attention keeps none anyway)
These are estimates from the shapes, not measurements; leave 10-20% for fragmentation,
communication buffers and the CUDA context.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # per parameter of an NF4 linear (models/nf4.py)
# Multi-latent attention's q/kv projections (megatron's names); `linear_qkv` stands for them all.
def mla_activation_elements(shape) -> int:
    """bf16 elements one token of one layer's multi-latent attention keeps for backward, every TP
    rank together (the module docstring lists them): the layer's input and the pre-MLP norm's
    input (2 h) and what the attention module keeps (mla_attention_kept)."""
    return 2 * shape.hidden_size + mla_attention_kept(shape)


def mla_attention_kept(shape) -> int:
    """The part the attention module itself keeps, per token: its input (h), the q and kv
    latents and their norms' outputs, the norms' fp32 copies (2 bf16 elements each), q, k, v
    and the output padded to one head size, linear_proj's input."""
    m, h, n = shape.mla, shape.hidden_size, shape.num_attention_heads
    width = max(m.q_head_dim, m.v_head_dim)  # SDPAttention's one head size
    latents = 4 * (m.q_lora_rank or 0) + 4 * m.kv_lora_rank
    return h + latents + 4 * n * width + n * m.v_head_dim


def _attention(s, r: int, targets) -> tuple:
    """(linear parameters, parameters whole on every TP rank, LoRA parameters, activation
    elements per token) of one layer's attention, every TP rank together."""
    h, heads, kv, d = s.hidden_size, s.num_attention_heads, s.num_query_groups, s.head_dim
    if s.mla is None:
        qkv = h * (heads + 2 * kv) * d
        lora = (("linear_qkv" in targets) * (r * h + (heads + 2 * kv) * d * r)
                + ("linear_proj" in targets) * (r * heads * d + h * r))
        return qkv + heads * d * h, 0, lora, 5 * h
    from megatron_lora.families.shape import MLA_INPUTS

    linears = s.mla.linear_shapes(h, heads)  # {name: (in, out)}
    adapted = [name for name in linears if name in targets or (
        name in MLA_INPUTS and "linear_qkv" in targets)]
    lora = sum(r * sum(linears[name]) for name in adapted)  # A [r, in] and B [out, r]
    norms = (s.mla.q_lora_rank or 0) + s.mla.kv_lora_rank
    return (sum(i * o for i, o in linears.values()), norms, lora,
            mla_activation_elements(s))


def estimate(cfg: dict, layout, world: int, seq: int, micro_batch: int, rank: int,
             targets=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"),
             unfused_attention: bool = False, recompute: str = None,
             base_quantization: str = "none") -> dict:
    """Bytes per GPU by part for the config.json dict `cfg` of any supported family (its sizes as
    megatron builds them: families.model_info; refused configs raise ModelConfigError)."""
    from megatron_lora.families import model_info
    from megatron_lora.families.shape import MLA_INPUTS

    s = model_info(cfg, source="--hf-config").shape
    h, f = s.hidden_size, s.ffn_hidden_size
    heads, kv = s.num_attention_heads, s.num_query_groups
    layers, experts, k = s.num_layers, s.num_experts, s.moe_router_topk
    vocab, d = s.vocab_size, s.head_dim
    fs = s.shared_expert_ffn_hidden_size or 0  # a shared expert: a dense SwiGLU every token
    fd = s.dense_ffn_hidden_size or 0  # dense layers between the MoE layers (moe_layer_pattern)
    tp, pp, ep, etp = layout.tp, layout.pp, layout.ep, layout.expert_tp
    per_stage = layers // pp
    pattern = s.moe_layer_pattern or (1,) * layers
    moe = max(sum(pattern[i:i + per_stage]) for i in range(0, layers, per_stage))  # the largest
    dense = per_stage - moe  # stage's: its MoE layers and the dense ones beside them
    if s.mla is not None and unfused_attention:
        raise ValueError("--unfused-attention: multi-latent attention runs on SDPAttention only "
                         "(models/mla.py); drop the flag")
    counted = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2") + MLA_INPUTS
    uncounted = [t for t in targets if t not in counted]
    if uncounted:
        raise ValueError(f"--lora-target-modules {' '.join(uncounted)}: not counted by this "
                         f"estimate; choose from {' '.join(counted)}")
    r = rank
    attn, attn_whole, lora_attn, attn_act = _attention(s, r, targets)
    expert = 3 * h * f
    linears = per_stage * attn + moe * 3 * h * fs + dense * 3 * h * fd  # dense decoder linears
    other = (moe * (experts * h + h * s.shared_expert_gate) + per_stage * 2 * h  # router, norms
             + h)  # the final norm
    whole = per_stage * attn_whole  # MLA's latent norms: on every TP rank
    fp32 = moe * experts * s.moe_router_expert_bias  # the routers' expert bias
    expert_other = 0  # per expert, beside its linears
    if s.add_bias_linear:  # q/k/v and sinks (TP-sharded), o and router (whole on each TP rank)
        other += (per_stage * ((heads + 2 * kv) * d + heads * s.attention_sinks + h * tp)
                  + moe * experts * tp)
        expert_other = 2 * f + h  # fc1 and fc2 biases
    linear_bytes = NF4_BYTES if base_quantization == "nf4" else 2
    weights = ((linears / tp + moe * experts * expert / (ep * etp)) * linear_bytes
               + (other / tp + moe * experts * expert_other / ep
                  + vocab * h / tp * (2 if pp == 1 else 1) + whole) * 2 + fp32 * 4)
    fc1, fc2 = "linear_fc1" in targets, "linear_fc2" in targets

    def lora_mlp(width):  # fc1 [2 width, h] and fc2 [h, width] adapters of one SwiGLU
        return fc1 * (r * h + 2 * width * r) + fc2 * (r * width + h * r)

    lora_dense = (per_stage * lora_attn + moe * lora_mlp(fs) * (fs > 0)
                  + dense * lora_mlp(fd))
    adapter_params = lora_dense / tp + moe * experts * lora_mlp(f) / (ep * etp)

    def act(width_moe):  # one layer's activations: attention, then its MLP's tokens
        return 2 * seq * micro_batch * (attn_act + h * width_moe) / tp

    act_moe = act(2 * k * (1 + 3 * f / h) + (1 + 3 * fs / h) * (fs > 0))
    act_dense = act(1 + 3 * fd / h)
    act_layer = max(act_moe, act_dense if dense else 0)
    if unfused_attention and recompute != "selective":
        # local spec: softmax input and output, [b, a/t, s, s] in bf16 each
        extra = 2 * 2 * micro_batch * heads * seq * seq / tp
        act_layer, act_moe, act_dense = act_layer + extra, act_moe + extra, act_dense + extra
    in_flight = pp if pp > 1 else 1
    if recompute == "full":  # layer inputs only, plus one layer being recomputed
        activations = 2 * seq * micro_batch * h / tp * per_stage * in_flight + act_layer
    else:
        activations = (act_moe * moe + act_dense * dense) * in_flight
    return {"weights": weights, "adapters": adapter_params * 2, "optimizer": adapter_params * 16,
            "activations": activations}


def main() -> None:
    from megatron_lora.runtime import ParallelLayout

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf-config", required=True)
    p.add_argument("--layouts", nargs="+", required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lora-target-modules", nargs="+", metavar="MODULE",
                   default=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
                   help="the adapted linears, megatron's names as train's flag (default "
                        "linear_qkv linear_proj linear_fc1 linear_fc2)")
    p.add_argument("--unfused-attention", action="store_true",
                   help="megatron's local attention (s x s scores kept) instead of flash attention")
    p.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="activation recomputation as train's flag (see the docstring)")
    p.add_argument("--base-quantization", choices=["none", "nf4"], default="none",
                   help="the frozen decoder linears in NF4, as train's flag")
    args = p.parse_args()
    cfg = json.load(open(args.hf_config))
    gib = 2 ** 30
    rows = []
    for name in args.layouts:  # every estimate first: a refusal prints no table
        layout = ParallelLayout.parse(name)
        try:
            e = estimate(cfg, layout, args.world, args.seq, args.micro_batch_size, args.rank,
                         targets=tuple(args.lora_target_modules),
                         unfused_attention=args.unfused_attention,
                         recompute=args.recompute_granularity,
                         base_quantization=args.base_quantization)
        except ValueError as err:  # a refused config or flag: one line
            p.error(f"{args.hf_config}: {err}")
        rows.append(f"| {name} | " + " | ".join(f"{v / gib:.1f} GiB" for v in e.values())
                    + f" | {sum(e.values()) / gib:.1f} GiB |")
    print(f"| layout (world {args.world}) | weights | adapters | optimizer | activations | total |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
