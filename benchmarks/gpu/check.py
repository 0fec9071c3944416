"""One-shot GPU check: Mixtral-8x7B (or Qwen3-30B-A3B, DeepSeek-V3) layers, bf16, seq 4096, one GPU.

    bash benchmarks/gpu/run.sh                       # on the GPU machine (installs .whl/ first)
    python benchmarks/gpu/check.py --base-quantization nf4   # + qlora (run.sh passes this)
    bash benchmarks/gpu/run.sh --shape qwen3-30b-a3b # Qwen3-30B-A3B layers (128 experts, top-8)
    python benchmarks/gpu/check.py --shape deepseek-v3       # DeepSeek-V3 layers (run.sh runs it)
    python benchmarks/gpu/check.py --tiny            # CPU smoke test (the suite runs it)

Builds a 2-layer model with Mixtral-8x7B layer shapes (h 4096, ffn 14336, 32 heads / 8 KV
groups, 8 experts top-2, vocab 32000, EP 1) in bf16 with the fast path (SDPAttention,
GroupedExperts), one micro-batch of [1, 4096] tokens, and times training steps of megatron-lora's
own stack (megatron DDP + megatron's optimizer with fp32 master weights, forward_backward);
benchmarks/gpu/modes.py says what each mode trains and which FLOPs it runs:
    frozen      base frozen except the final norm: backward never enters a decoder layer (a
                forward plus the output layer's input gradient)
    floor       frozen, with the decoder input requiring grad: backward runs through every
                decoder layer, input gradients only (the floor a LoRA step can approach)
    lora        LoRA r=16 on linear_qkv, linear_proj and every expert's fc1/fc2, base frozen
    full        every parameter trained
    dora        the LoRA of `lora` with DoRA (train --lora-use-dora)
    prefix      prefix tuning, 20 virtual tokens per layer (train --peft-type prefix)
    lora_sequential / frozen_sequential   the same with megatron's SequentialMLP experts
    qlora       (--base-quantization nf4) the LoRA of `lora` on a frozen base whose decoder
                linears (attention, every expert's fc1/fc2) are held in NF4 (models/nf4_model.py
                quantize_base: bitsandbytes quantises each global weight on CPU after the bf16
                model is built; the peak memory is reset after that, so it is the step's), at
                every shape (run.sh leaves it out at DeepSeek-V3's: quantising its 25 B
                parameters on the host would take most of a device call)
--modes NAME ... times only those modes (default: all of the shape's).
--shape qwen3-30b-a3b builds 2 layers of Qwen3-30B-A3B instead (h 2048, 32 heads of 128 / 4 KV
groups, per-head q/k RMSNorm, 128 experts top-8 of ffn 768, vocab 151936) and times every mode
(the MoE layer is where grouped experts must pay: 128 small GEMMs per weight in the sequential
loop).
--shape deepseek-v3 builds 2 MoE layers of DeepSeek-V3 (h 7168; multi-latent attention: 128
heads, q_lora_rank 1536, kv_lora_rank 512, nope 128 + rope 64 per query/key head, v 128, YaRN
factor 40 over 4096; 256 routed experts top-8 of ffn 2048, sigmoid scores with the expert bias,
8 groups of which 4 are kept, scaling 2.5, one shared expert of 2048; vocab 129280), about 25 B
parameters (50 GB in bf16), and times frozen, floor and lora (LoRA r=16 on linear_qkv, i.e.
each MLA q/kv down and up projection, linear_proj and every fc1/fc2, routed and shared); full
fine-tuning of 25 B parameters (fp32 master weights and Adam: 16 bytes each) does not fit one
GPU, and its DoRA is left out for the device call's time (--modes dora times it).
Each mode: --warmup steps, then the best and the mean of --steps timed steps (CUDA-synchronised
wall time), tokens/s, peak memory (torch.cuda.max_memory_allocated, reset per mode).

Model FLOPs per token: what each mode runs (modes.py flops_per_token, from the parts of
training/flops.py's lora_step_flops, what `train` logs): frozen 2 N + A + 2 h V (forward and the
output layer's input gradient), floor 4 N + 3 A (forward and input gradients), lora, dora, prefix
and qlora the floor + their adapters' forward, input and weight gradients (train's count),
full 6 N + 3 A; N = the base linears' MACs a token visits (attention linears, router, top-k
experts, output layer), A = the attention's forward (2 s d_attn per layer, causal half). MFU =
model TFLOP/s / the device's dense bf16 peak (the table in training/flops.py; --peak-tflops
overrides it; none on CPU).

In the same run, after frozen, floor, lora and full and before the other modes, the peer users
would pick instead: Hugging Face transformers + PEFT at the same shapes (benchmarks/gpu/peer.py:
frozen, floor, PEFT LoRA r=16 on q/k/v/o plus `target_parameters` on the fused expert tensors,
full; --no-peer skips it; DeepSeek-V3 has none). --time-budget S skips each mode (ours or the
peer's) that would end after S seconds by the longest mode so far, so that a device call's time
limit still sees the JSON line (`skipped` names them).

Prints a table, the ratios, then one JSON line: per mode tokens_per_s, ms_per_step,
flops_per_token, model_tflops, mfu (null without a peak), peak_memory_bytes, trainable_parameters
and parameters (the elements of model.parameters()) (qlora also nf4_linears and
nf4_bytes_per_parameter, the bytes its NF4 linears hold per parameter they stand for); step-time
ratios (null when a mode was not timed): lora_over_floor, floor_over_frozen, lora_over_frozen,
lora_over_full, dora_over_lora, prefix_over_lora, qlora_over_lora,
grouped_over_sequential_lora and _frozen; peer (the peer's modes, or null) and
lora_over_peft_lora, frozen_over_peft_frozen (our forward over transformers'),
floor_over_peft_floor, full_over_peft_full, peft_lora_over_peft_floor; the shape; skipped;
seconds. Designed to finish well inside 8 minutes on an H200 (model builds dominate).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

from benchmarks.gpu.modes import flops_per_token  # noqa: E402

SHAPE_8X7B = dict(vocab_size=32000, hidden_size=4096, ffn_hidden_size=14336, num_layers=2,
                  num_attention_heads=32, num_query_groups=8, num_experts=8, moe_router_topk=2,
                  max_position_embeddings=4096, rotary_base=1e6, norm_epsilon=1e-5)
# Qwen3-30B-A3B's config.json sizes (2 of its 48 layers); norm_topk_prob true (renormalised).
SHAPE_QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, ffn_hidden_size=768, num_layers=2,
                           num_attention_heads=32, num_query_groups=4, kv_channels=128,
                           qk_layernorm=True, num_experts=128, moe_router_topk=8,
                           max_position_embeddings=4096, rotary_base=1e6, norm_epsilon=1e-6)
# DeepSeek-V3's config.json sizes (2 of its 58 MoE layers; examples/deepseek_v3/config.json).
SHAPE_DEEPSEEK_V3 = dict(
    vocab_size=129280, hidden_size=7168, ffn_hidden_size=2048, num_layers=2,
    num_attention_heads=128, num_query_groups=128, kv_channels=192, num_experts=256,
    moe_router_topk=8, shared_expert_ffn_hidden_size=2048, moe_router_score_function="sigmoid",
    moe_router_expert_bias=True, moe_router_num_groups=8, moe_router_group_topk=4,
    moe_router_topk_scaling_factor=2.5, max_position_embeddings=4096, rotary_base=10000.0,
    norm_epsilon=1e-6,
    yarn=dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
              mscale=1.0, mscale_all_dim=1.0),
    mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64,
             v_head_dim=128))
SHAPES = {"mixtral-8x7b": SHAPE_8X7B, "qwen3-30b-a3b": SHAPE_QWEN3_30B_A3B,
          "deepseek-v3": SHAPE_DEEPSEEK_V3}
SHAPE_TINY = dict(vocab_size=256, hidden_size=64, ffn_hidden_size=96, num_layers=2,
                  num_attention_heads=4, num_query_groups=2, num_experts=4, moe_router_topk=2,
                  max_position_embeddings=64, rotary_base=1e6, norm_epsilon=1e-5)
# Which modes each shape times (mode, grouped experts), in order (the peer runs after the first
# four); qlora is added by --base-quantization nf4.
ALL_MODES = [("frozen", True), ("floor", True), ("lora", True), ("full", True), ("dora", True),
             ("prefix", True), ("lora", False), ("frozen", False)]
CORE = ("frozen", "floor", "lora", "full")
# DeepSeek-V3's 25 B parameters leave no room for full fine-tuning (16 bytes each) on one GPU;
# prefix tuning is not built for multi-latent attention; DoRA (every one of its 512 expert
# linears' norms each forward) is left out of the device call's 100 s.
SHAPE_MODES = {"deepseek-v3": ("frozen", "floor", "lora")}


def shape_modes(name: str, extra=()) -> list:
    """(mode, grouped experts) that --shape `name` times, in order (`extra`: modes asked for by
    --modes beyond the shape's own)."""
    modes = [m for m in ALL_MODES if m[0] in SHAPE_MODES.get(name, (m[0],)) or m[0] in extra]
    if name == "deepseek-v3":  # 256 experts: grouped only (the sequential loop adds nothing new)
        modes = [m for m in modes if m[1]]
    return modes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(shape: dict, grouped: bool, dtype, device):
    from megatron.core import parallel_state

    from megatron_lora.models.gpt import ModelShape, build_gpt_model, transformer_config
    from megatron_lora.models.specs import local_block_spec
    from megatron_lora.runtime import ParallelLayout

    model_shape = ModelShape(**shape)
    # On a GPU megatron initialises the weights there (CPU initialisation of 3 B parameters
    # would dominate the check).
    config = transformer_config(model_shape, ParallelLayout(), dtype=dtype,
                                use_cpu_initialization=device.type == "cpu")
    spec = local_block_spec(config, pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                            moe_grouped_gemm=grouped, attention_backend="flash")
    model = build_gpt_model(model_shape, config, block_spec=spec)
    return model.to(device)


def run_mode(mode: str, grouped: bool, shape: dict, args, dtype, device) -> dict:
    import torch

    from benchmarks.gpu.modes import prepare
    from megatron_lora.training.optimizer import OptimConfig, wrap_for_training
    from megatron_lora.training.step import forward_backward

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = build(shape, grouped, dtype, device)
    nf4 = {}
    if mode == "qlora":
        from megatron_lora.models.nf4_model import nf4_held, quantize_base

        nf4["nf4_linears"] = quantize_base(model)
        held, params = nf4_held(model)
        nf4["nf4_bytes_per_parameter"] = round(held / params, 4)
        gc.collect()
        if cuda:  # the step's peak, not the bf16 model's before quantisation
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    prepare(model, mode)
    wrapped, optimizer, _ = wrap_for_training(
        [model], OptimConfig(lr=1e-5, train_iters=1000, lr_decay_style="constant"))
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, shape["vocab_size"], (1, args.seq + 1), generator=gen).to(device)
    times = []
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        wrapped[0].zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(wrapped, rows[:, :-1], rows[:, 1:], micro_batch_size=1)
        optimizer.step()
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    best = min(times)
    per_token = flops_per_token(shape, args.seq, mode)
    tflops = per_token * args.seq / best / 1e12
    result = {
        "ms_per_step": round(best * 1e3, 2),
        "mean_ms_per_step": round(sum(times) / len(times) * 1e3, 2),
        "tokens_per_s": round(args.seq / best, 1),
        "flops_per_token": per_token,
        "model_tflops": float(f"{tflops:.6g}"),
        "mfu": round(tflops / args.peak_tflops, 4) if args.peak_tflops else None,
        "peak_memory_bytes": int(torch.cuda.max_memory_allocated()) if cuda else None,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "parameters": sum(p.numel() for p in model.parameters()),
        **nf4,
    }
    del wrapped, optimizer, model
    gc.collect()
    return result


PEER_MODES = ("frozen", "floor", "lora", "full")
# Step-time ratios the JSON line carries (a_over_b), null where a mode was not timed.
RATIOS = [("lora", "floor"), ("floor", "frozen"), ("lora", "frozen"), ("lora", "full"),
          ("dora", "lora"), ("prefix", "lora"), ("qlora", "lora")]
PEER_RATIOS = [("lora", "peft_lora"), ("frozen", "peft_frozen"), ("floor", "peft_floor"),
               ("full", "peft_full"), ("peft_lora", "peft_floor")]


def _time_peer(args, shape, device, modes, fits, longest):
    """transformers + PEFT (peer.py) in `modes`, each if it `fits`: {mode: timing}, or None
    when the shape has no peer."""
    import torch

    from benchmarks.gpu.peer import time_peer

    peer = {}
    for mode in modes:
        if not fits(f"peft_{mode}"):
            continue
        begun = time.time()
        got = time_peer(args.shape, shape, seq=args.seq, steps=args.steps, warmup=args.warmup,
                        device=device, dtype=torch.bfloat16, modes=[mode])
        longest[0] = max(longest[0], time.time() - begun)
        if got is None:
            return None
        if "error" in got:  # transformers missing
            return got
        peer.update(got)
        r = got[mode]
        if "ms_per_step" in r:
            mem = "-" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.1f}"
            print(f"{'peft_' + mode:18s} {r['ms_per_step']:9.1f} ms {r['tokens_per_s']:10.0f} "
                  f"tok/s   (transformers + PEFT)  peak {mem} GiB", flush=True)
    return peer


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (smoke test)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="mixtral-8x7b",
                        help="the layer shapes (default mixtral-8x7b)")
    parser.add_argument("--seq", type=int, default=None, help="default 4096 (tiny: 64)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=None, help="default 3")
    parser.add_argument("--base-quantization", choices=["none", "nf4"], default="none",
                        help="nf4: also time qlora, LoRA on an NF4 base (needs bitsandbytes)")
    parser.add_argument("--modes", nargs="+", default=None,
                        help="time only these modes (default: all of the shape's)")
    parser.add_argument("--no-peer", dest="peer", action="store_false",
                        help="skip timing Hugging Face transformers + PEFT at the same shapes "
                             "(benchmarks/gpu/peer.py)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="skip modes that would end after this many seconds (the longest "
                             "mode so far as the estimate); the JSON line names them")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="one device's peak for MFU (default: the device's dense bf16 peak "
                             "from training/flops.py; none on CPU)")
    args = parser.parse_args(argv)
    started = time.time()
    import torch

    args.seq = args.seq or (64 if args.tiny else 4096)
    args.steps = args.steps or (2 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    shape = SHAPE_TINY if args.tiny else SHAPES[args.shape]
    if args.tiny and args.shape == "qwen3-30b-a3b":  # the same quirks at tiny sizes
        shape = dict(shape, kv_channels=24, qk_layernorm=True, num_experts=8, moe_router_topk=4)
    if args.tiny and args.shape == "deepseek-v3":  # MLA, sigmoid group routing, shared expert
        shape = dict(shape, num_query_groups=4, kv_channels=None, num_experts=16,
                     moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
                     shared_expert_ffn_hidden_size=96,
                     yarn=dict(SHAPE_DEEPSEEK_V3["yarn"], factor=4.0,
                               original_max_position_embeddings=16),
                     mla=dict(q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8,
                              qk_pos_emb_head_dim=4, v_head_dim=10),
                     moe_router_score_function="sigmoid", moe_router_expert_bias=True,
                     moe_router_topk_scaling_factor=2.5)
    if args.tiny and args.base_quantization == "nf4":  # NF4 blocks: widths multiple of 64
        shape = dict(shape, ffn_hidden_size=128,
                     **({"kv_channels": 32} if shape.get("kv_channels") else {}))
        if "mla" in shape:  # every MLA linear's input 64 wide: latents, 4 heads x v 16
            shape = dict(shape, shared_expert_ffn_hidden_size=128,
                         mla=dict(q_lora_rank=64, kv_lora_rank=64, qk_head_dim=8,
                                  qk_pos_emb_head_dim=8, v_head_dim=16))
    shape = dict(shape, max_position_embeddings=max(shape["max_position_embeddings"], args.seq))
    if not torch.cuda.is_available() and not args.tiny:
        raise SystemExit("benchmarks/gpu/check.py: no CUDA device; use --tiny for the CPU "
                         "smoke test")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    from megatron_lora import runtime
    from megatron_lora.runtime import ParallelLayout

    runtime.initialize(ParallelLayout(), seed=1234)
    device = runtime.device()  # the rank's GPU (the CPU for --tiny without one)
    if args.peak_tflops is None and device.type == "cuda":
        from megatron_lora.training.flops import bf16_peak_tflops

        args.peak_tflops = bf16_peak_tflops(torch.cuda.get_device_name())
    modes = shape_modes(args.shape, extra=args.modes or ())
    if args.base_quantization == "nf4":
        modes.append(("qlora", True))
    if args.modes:
        known = {m if grouped else f"{m}_sequential" for m, grouped in modes}
        unknown = sorted(set(args.modes) - known)
        if unknown:
            raise SystemExit(f"benchmarks/gpu/check.py: --modes {' '.join(unknown)}: not modes of "
                             f"this run (choose from {', '.join(sorted(known))})")
        modes = [(m, g) for m, g in modes if (m if g else f"{m}_sequential") in args.modes]
    results, peer, skipped, longest = {}, None, [], [0.0]

    def fits(name: str) -> bool:
        """Whether `name` may start: it would end inside --time-budget by the longest so far."""
        if args.time_budget is None or time.time() - started + longest[0] <= args.time_budget:
            return True
        skipped.append(name)
        print(f"{name:18s} skipped: {time.time() - started:.0f} s gone, the longest mode took "
              f"{longest[0]:.0f} s, --time-budget {args.time_budget:.0f} s", flush=True)
        return False

    core = [m for m in modes if m[1] and m[0] in CORE]
    for item in core + ["peer"] + [m for m in modes if m not in core]:
        if item == "peer":
            peer = _time_peer(args, shape, device, [m for m in PEER_MODES if m in results],
                              fits, longest) if args.peer else None
            continue
        mode, grouped = item
        key = mode if grouped else f"{mode}_sequential"
        if not fits(key):
            continue
        begun = time.time()
        results[key] = r = run_mode(mode, grouped, shape, args, torch.bfloat16, device)
        longest[0] = max(longest[0], time.time() - begun)
        mem = "-" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**30:.1f}"
        mfu = "  -   " if r["mfu"] is None else f"{r['mfu'] * 100:5.1f}%"
        print(f"{key:18s} {r['ms_per_step']:9.1f} ms {r['tokens_per_s']:10.0f} tok/s "
              f"{r['model_tflops']:8.1f} TFLOP/s  MFU {mfu}  peak {mem} GiB",
              flush=True)
    runtime.shutdown()
    ms = {k: v["ms_per_step"] for k, v in results.items()}
    if isinstance(peer, dict):
        ms.update({f"peft_{k}": v["ms_per_step"] for k, v in peer.items()
                   if isinstance(v, dict) and "ms_per_step" in v})

    def ratio(a, b):
        return round(ms[a] / ms[b], 4) if a in ms and b in ms else None

    summary = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape_name": args.shape,
        "shape": dict(shape, seq_length=args.seq, dtype="bf16", micro_batch_size=1),
        "modes": results,
        "base_quantization": args.base_quantization,
        **{f"{a}_over_{b}": ratio(a, b) for a, b in RATIOS},
        "grouped_over_sequential_lora": ratio("lora", "lora_sequential"),
        "grouped_over_sequential_frozen": ratio("frozen", "frozen_sequential"),
        "peer": peer,
        **{f"{a}_over_{b}": ratio(a, b) for a, b in PEER_RATIOS},
        "flop_formula": "benchmarks/gpu/modes.py flops_per_token: frozen 2N + A + 2hV, floor "
                        "4N + 3A, lora/dora/prefix/qlora 4N + 3A + adapters "
                        "(training.flops.lora_step_flops), full 6N + 3A; A = attention forward "
                        "= 2*L*s*d_attn (causal half; MLA: L*s*n*(qk + v))",
        "peak_tflops": args.peak_tflops,
        "skipped": skipped,
        "seconds": round(time.time() - started, 1),
    }
    print("  ".join(f"{k} {v:.3f}" for k, v in summary.items()
                    if k.endswith(tuple(f"_over_{b}" for _, b in RATIOS + PEER_RATIOS))
                    and isinstance(v, float)), flush=True)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
