"""Grouped experts (models/grouped_experts.py) against megatron's SequentialMLP, CPU, one run.

    .venv/bin/python benchmarks/grouped_experts.py            # about 5 minutes on 2 CPU cores
    .venv/bin/python benchmarks/grouped_experts.py --tiny     # seconds (the suite's smoke test)

Frozen-base forward + backward of the experts module alone (the dispatcher's rows in, their
outputs out, input gradient and LoRA gradients), LoRA r=16 on every expert's fc1 and fc2, fp32,
for
    e8:  8 local experts,  h 1024, ffn 3584, 4096 tokens, top-2 (8192 rows)
    e64: 64 local experts, h 1024, ffn 512,  4096 tokens, top-8 (32768 rows)
    e128: Qwen3-30B-A3B's MoE layer: 128 experts, h 2048, ffn 768, 1024 tokens, top-8 (8192 rows;
          about 7 GB of fp32 weights for the three variants)
Three variants: GroupedExperts as it runs on CPU (runs of whole experts whose intermediates fit
in cache, fc1 -> activation -> fc2 per run), GroupedExperts in one run of all experts (the CUDA
order: every row's fc1, then the activation, then fc2), and SequentialMLP.
Rows are split over the experts by a seeded random routing. Each variant is timed as the best
process CPU time (other jobs cannot inflate it by descheduling this process) of interleaved
runs after a warm-up, so load hits both alike, on one torch thread (--threads): with two, process
CPU time also counts OpenMP's idle worker spinning between kernels, which charges the variant with
more, smaller kernels for time it did not compute. Ends with one JSON line:
grouped_over_sequential_e8, _e64, _e128 (grouped time / sequential time) and
one_run_over_sequential_* (the one-run variant's).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"e8": dict(experts=8, hidden=1024, ffn=3584, tokens=4096, topk=2),
          "e64": dict(experts=64, hidden=1024, ffn=512, tokens=4096, topk=8),
          "e128": dict(experts=128, hidden=2048, ffn=768, tokens=1024, topk=8)}
TINY = {"e8": dict(experts=8, hidden=64, ffn=96, tokens=64, topk=2),
        "e64": dict(experts=64, hidden=64, ffn=32, tokens=64, topk=8),
        "e128": dict(experts=128, hidden=64, ffn=24, tokens=64, topk=8)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_rank() -> None:
    """A one-rank gloo world with megatron initialised (no-op if already initialised)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    from megatron_lora import runtime
    from megatron_lora.runtime import ParallelLayout

    runtime.initialize(ParallelLayout(), seed=1234, backend="gloo")


def build_experts(grouped: bool, experts: int, hidden: int, ffn: int, rank: int = 16,
                  dtype=torch.float32):
    """(MoELayer, its experts module) with LoRA on every expert's fc1/fc2 (frozen base)."""
    import zlib

    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_lora.lora import AdapterConfig
    from megatron_lora.lora.experts import wrap_experts
    from megatron_lora.models.gpt import tiny_moe_shape, transformer_config
    from megatron_lora.models.specs import local_layer_spec
    from megatron_lora.runtime import ParallelLayout
    from megatron_lora.runtime.versions import spec_submodules

    shape = tiny_moe_shape(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts,
                               num_layers=1, num_attention_heads=8, num_query_groups=8)
    config = transformer_config(shape, ParallelLayout(), dtype=dtype)
    spec = spec_submodules(local_layer_spec(experts, moe_grouped_gemm=grouped)).mlp
    layer = MoELayer(config, submodules=spec_submodules(spec), layer_number=1)
    cfg = AdapterConfig(rank=rank, alpha=2 * rank, init_lora_weights=False)
    wrap_experts(layer.experts, cfg, prefix="decoder.layers.0.mlp.experts",
                 seed_for=lambda n: zlib.crc32(n.encode()), moe_layer=layer)
    return layer, layer.experts


def step_fn(module, experts, hidden, tokens, topk, dtype=torch.float32):
    """A closure running one forward+backward of `module` on seeded dispatcher-like rows."""
    gen = torch.Generator().manual_seed(0)
    rows = tokens * topk
    counts = torch.multinomial(torch.ones(experts), rows, replacement=True,
                               generator=gen).bincount(minlength=experts)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    probs = torch.rand(rows, generator=gen).to(dtype)

    def step():
        xi = x.clone().requires_grad_(True)
        out, _ = module(xi, counts, probs)
        out.sum().backward()

    return step


def _cpu_time(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def compare(shape: dict, reps: int) -> dict:
    """{grouped_s, grouped_one_run_s, sequential_s, ratio, one_run_ratio} for one shape (best
    interleaved CPU times). grouped: GroupedExperts as it runs on CPU, in cache-sized runs of
    experts; one_run: all experts' fc1, then the activation, then fc2 (its CUDA order)."""
    from megatron_lora.models import grouped_experts as G

    steps, chunk_bytes = {}, {"grouped": G.CPU_CHUNK_BYTES, "one_run": 0, "sequential": 0}
    for variant in chunk_bytes:
        _, experts = build_experts(variant != "sequential", shape["experts"], shape["hidden"],
                                   shape["ffn"])
        experts.train()
        steps[variant] = step_fn(experts, shape["experts"], shape["hidden"], shape["tokens"],
                                 shape["topk"])
    best = {variant: float("inf") for variant in steps}
    saved = G.CPU_CHUNK_BYTES
    try:
        for rep in range(reps + 1):  # the first round warms up
            for variant, step in steps.items():
                G.CPU_CHUNK_BYTES = chunk_bytes[variant]
                seconds = _cpu_time(step)
                if rep:
                    best[variant] = min(best[variant], seconds)
    finally:
        G.CPU_CHUNK_BYTES = saved
    return {"grouped_s": best["grouped"], "grouped_one_run_s": best["one_run"],
            "sequential_s": best["sequential"], "ratio": best["grouped"] / best["sequential"],
            "one_run_ratio": best["one_run"] / best["sequential"]}


def measure(reps: int = 3, tiny: bool = False, only=None) -> dict:
    """{"grouped_over_sequential_e8": r8, "grouped_over_sequential_e64": r64, "rows": {...}}."""
    init_single_rank()
    rows = {name: compare(shape, reps) for name, shape in (TINY if tiny else SHAPES).items()
            if only is None or name in only}
    result = {f"grouped_over_sequential_{name}": row["ratio"] for name, row in rows.items()}
    result.update({f"one_run_over_sequential_{name}": row["one_run_ratio"]
                   for name, row in rows.items()})
    result["rows"] = rows
    return result


def print_table(result: dict, tiny: bool = False) -> None:
    shapes = TINY if tiny else SHAPES
    print(f"{'case':5s} {'experts':>7s} {'h':>5s} {'ffn':>5s} {'rows':>6s} {'grouped s':>10s} "
          f"{'one run s':>10s} {'sequential s':>12s} {'ratio':>6s} {'one run':>8s}")
    for name, row in result["rows"].items():
        s = shapes[name]
        print(f"{name:5s} {s['experts']:7d} {s['hidden']:5d} {s['ffn']:5d} "
              f"{s['tokens'] * s['topk']:6d} {row['grouped_s']:10.3f} "
              f"{row['grouped_one_run_s']:10.3f} {row['sequential_s']:12.3f} "
              f"{row['ratio']:6.3f} {row['one_run_ratio']:8.3f}")


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke test)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: see the module docstring)")
    parser.add_argument("--only", nargs="+", choices=sorted(SHAPES), default=None,
                        help="only these shapes")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = measure(args.reps, args.tiny, args.only)
    print_table(result, args.tiny)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
