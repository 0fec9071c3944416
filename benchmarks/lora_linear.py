"""Benchmark: what LoRA adds to a Mixtral-shaped pair of megatron parallel linears.

    .venv/bin/python benchmarks/lora_linear.py            # h=1024, ffn=3584, r=16, 2048 tokens

Layer: fc1 = ColumnParallelLinear(h -> ffn), fc2 = RowParallelLinear(ffn -> h), SiLU between,
fp32 (a Mixtral MLP with the SwiGLU gate left out, scaled for CPU).

1. Collective bytes the LoRA path adds per layer per training step (forward + backward), counted by
   wrapping torch.distributed's collectives, at TP=2 for every layout (column/row x SP x
   gather_output / replicated row input), beside the analytic minimum. A collective counts as
   hidden-sized when no dimension of its tensor is r.
2. Bytes saved for backward (torch.autograd.graph.saved_tensors_hooks, parameters excluded),
   frozen base alone vs base + LoRA, dropout 0 and 0.1, one rank, per token.
3. Training-step time (forward + backward) of base + LoRA vs the frozen base vs full fine-tuning
   of the base, interleaved in one run, best of --reps, one torch thread per rank, by process CPU
   time and by wall clock, at one rank and at TP=2 (+SP).

The last line printed is one JSON object (keys: hidden_collective_bytes,
extra_saved_bytes_per_token_dropout0, extra_saved_bytes_per_token_dropout01, lora_over_frozen,
lora_over_full, plus details). lora_over_frozen / lora_over_full are the single-rank CPU-time
ratios; wall_* and tp2 hold the others.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=3584)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=9, help="timed steps per configuration")
    ap.add_argument("--no-tp2", action="store_true", help="skip the two-rank parts")
    return ap.parse_args(argv)


# ------------------------------------------------------------------------------------------
# building blocks (run inside an initialised megatron world)
# ------------------------------------------------------------------------------------------
def _config(tp: int, sp: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=4, tensor_model_parallel_size=tp,
        sequence_parallel=sp, use_cpu_initialization=True, params_dtype=torch.float32,
    )


def _linear(kind: str, n_in: int, n_out: int, tp: int, sp: bool, flag: bool = None):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    init = lambda w: torch.nn.init.normal_(w, std=0.02)  # noqa: E731
    if kind == "column":
        return ColumnParallelLinear(n_in, n_out, config=_config(tp, sp), init_method=init,
                                    bias=False, gather_output=bool(flag))
    return RowParallelLinear(n_in, n_out, config=_config(tp, sp), init_method=init, bias=False,
                             input_is_parallel=True if flag is None else flag,
                             skip_bias_add=False)


def _adapt(base, rank: int, dropout: float = 0.0):
    from megatron_lora.lora import AdapterConfig, LoraAdapter

    return LoraAdapter(base, AdapterConfig(rank=rank, alpha=2.0 * rank, dropout=dropout,
                                           init_lora_weights=False))


def _step(module, x, g):
    out, _ = module(x)
    out.backward(g)


def _tp_rank():
    from megatron.core import parallel_state

    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


# ------------------------------------------------------------------------------------------
# 1. collectives
# ------------------------------------------------------------------------------------------
LAYOUTS = [  # name, kind, sp, flag (column: gather_output; row: input_is_parallel)
    ("column", "column", False, False),
    ("column+SP", "column", True, False),
    ("column+gather_output", "column", False, True),
    ("row", "row", False, True),
    ("row+SP", "row", True, True),
    ("row, replicated input", "row", False, False),
]


def _analytic(kind, sp, flag, n_in, n_out, tokens, r, t):
    """Minimum LoRA-added collectives (fp32 bytes of the full-size tensor) at TP=t."""
    act = 4 * tokens * r
    if kind == "column":
        if flag:  # gather_output: gather B; with SP also the [T/t, r] shards of u
            return 4 * n_out * r + (act if sp else 0)
        return 2 * act if sp else act
    if not flag:  # replicated row input: gather A
        return 4 * r * n_in
    return 2 * act if sp else act


def measure_collectives(args, t=2):
    from megatron_lora.lora.accounting import record_collectives

    rank, _ = _tp_rank()
    h, ffn, r, T = args.hidden, args.ffn, args.rank, args.tokens
    rows = []
    for name, kind, sp, flag in LAYOUTS:
        n_in, n_out = (h, ffn) if kind == "column" else (ffn, h)
        if kind == "column":
            x_shape = (T // t if sp else T, 1, n_in)
            out_dim = n_out if flag else n_out // t
            g_shape = (T, 1, out_dim)
        else:
            x_shape = (T, 1, n_in // t if flag else n_in)
            g_shape = (T // t if sp else T, 1, n_out)
        gen = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(*x_shape, generator=gen).requires_grad_(True)
        g = torch.randn(*g_shape, generator=gen)
        base = _linear(kind, n_in, n_out, t, sp, flag)
        base.weight.requires_grad_(False)
        with record_collectives() as base_calls:
            _step(base, x, g)
        adapter = _adapt(base, r)
        with record_collectives() as lora_calls:
            _step(adapter, x, g)
        added = Counter((c.op, c.shape, c.nbytes) for c in lora_calls)
        added.subtract(Counter((c.op, c.shape, c.nbytes) for c in base_calls))
        extra = [(op, shape, nb) for (op, shape, nb), n in added.items() for _ in range(n)]
        hidden = sum(nb for op, shape, nb in extra if r not in shape)
        rows.append({
            "layout": name,
            "lora_calls": [f"{op}{list(shape)}" for op, shape, _ in extra],
            "lora_bytes": sum(nb for _, _, nb in extra),
            "hidden_bytes": hidden,
            "analytic_min_bytes": _analytic(kind, sp, flag, n_in, n_out, T, r, t),
            "base_bytes": sum(c.nbytes for c in base_calls),
        })
    return rows


# ------------------------------------------------------------------------------------------
# 2. saved activations (one rank)
# ------------------------------------------------------------------------------------------
def measure_saved(args):
    from megatron_lora.lora.accounting import record_saved_tensors

    h, ffn, r, T = args.hidden, args.ffn, args.rank, args.tokens
    out = {}
    for kind, n_in, n_out in (("column", h, ffn), ("row", ffn, h)):
        x = torch.randn(T, 1, n_in).requires_grad_(True)
        g = torch.randn(T, 1, n_out)
        base = _linear(kind, n_in, n_out, 1, False, None if kind == "row" else False)
        base.weight.requires_grad_(False)
        with record_saved_tensors(exclude=list(base.parameters())) as saved:
            _step(base, x, g)
        base_bytes = sum(s.nbytes for s in saved)
        for p in (0.0, 0.1):
            adapter = _adapt(base, r, dropout=p)
            with record_saved_tensors(exclude=list(adapter.parameters())) as saved:
                _step(adapter, x, g)
            extra = sum(s.nbytes for s in saved) - base_bytes
            out[f"{kind}(in={n_in}) p={p}"] = {
                "frozen_base_bytes_per_token": base_bytes / T,
                "extra_bytes_per_token": extra / T,
                "saved": [f"{list(s.shape)}:{str(s.dtype)[6:]}" for s in saved],
            }
    return out


# ------------------------------------------------------------------------------------------
# 3. step time
# ------------------------------------------------------------------------------------------
def _mlp(args, t, sp, mode):
    """fc1 (column) -> SiLU -> fc2 (row), as a callable step over (x, g)."""
    h, ffn, r = args.hidden, args.ffn, args.rank
    fc1 = _linear("column", h, ffn, t, sp, False)
    fc2 = _linear("row", ffn, h, t, sp, True)
    full = mode == "full"
    for m in (fc1, fc2):
        m.weight.requires_grad_(full)
    if mode == "lora":
        fc1, fc2 = _adapt(fc1, r), _adapt(fc2, r)
    params = [p for m in (fc1, fc2) for p in m.parameters() if p.requires_grad]

    def step(x, g):
        for p in params:
            p.grad = None
        y, _ = fc2(torch.nn.functional.silu(fc1(x)[0]))
        y.backward(g)

    return step


def measure_step_time(args, t=1, sp=False):
    """Best-of-reps step times, wall clock and process CPU time, interleaved across configs.

    Each rank runs one torch thread. On a shared machine other processes only ever add time,
    so the minimum is the least disturbed estimate; process CPU time is further immune to being
    descheduled (with one compute thread it is the step's compute cost). Ratios are reported
    for both; medians of wall time are kept for reference.
    """
    rank, _ = _tp_rank()
    T, h = args.tokens, args.hidden
    gen = torch.Generator().manual_seed(5 + rank)
    x = torch.randn(T // t if sp else T, 1, h, generator=gen).requires_grad_(True)
    g = torch.randn(T // t if sp else T, 1, h, generator=gen)
    steps = {mode: _mlp(args, t, sp, mode) for mode in ("frozen", "lora", "full")}
    for step in steps.values():  # warm-up
        step(x, g)
    wall = {mode: [] for mode in steps}
    cpu = {mode: [] for mode in steps}
    for _ in range(args.reps):  # interleaved, so machine-load drift hits every config alike
        for mode, step in steps.items():
            if t > 1:
                torch.distributed.barrier()
            w0, c0 = time.perf_counter(), time.process_time()
            step(x, g)
            wall[mode].append(time.perf_counter() - w0)
            cpu[mode].append(time.process_time() - c0)
    best = {mode: min(v) for mode, v in wall.items()}
    best_cpu = {mode: min(v) for mode, v in cpu.items()}
    med = {mode: statistics.median(v) for mode, v in wall.items()}
    return {
        "wall_seconds": best,
        "cpu_seconds": best_cpu,
        "median_wall_seconds": med,
        "wall_lora_over_frozen": best["lora"] / best["frozen"],
        "wall_lora_over_full": best["lora"] / best["full"],
        "cpu_lora_over_frozen": best_cpu["lora"] / best_cpu["frozen"],
        "cpu_lora_over_full": best_cpu["lora"] / best_cpu["full"],
    }


# ------------------------------------------------------------------------------------------
# drivers
# ------------------------------------------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, world, port, tp, threads):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    from megatron_lora import runtime
    from megatron_lora.runtime import ParallelLayout

    runtime.initialize(ParallelLayout(tp=tp), seed=1234, backend="gloo")


def _tp2_worker(rank, args, port, result_path):
    import warnings

    warnings.filterwarnings("ignore")
    _init(rank, 2, port, 2, threads=1)
    result = {"collectives": measure_collectives(args),
              "step_time_tp2_sp": measure_step_time(args, t=2, sp=True)}
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(result, f)
    from megatron_lora import runtime

    runtime.shutdown()


def main(argv=None):
    import warnings

    warnings.filterwarnings("ignore")
    args = _parse(argv)
    started = time.perf_counter()
    result = {"shape": {"hidden": args.hidden, "ffn": args.ffn, "rank": args.rank,
                        "tokens": args.tokens, "dtype": "float32", "reps": args.reps}}
    if not args.no_tp2:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "tp2.json")
            mp.spawn(_tp2_worker, args=(args, _free_port(), path), nprocs=2, join=True)
            with open(path) as f:
                result.update(json.load(f))
    _init(0, 1, _free_port(), 1, threads=1)
    result["saved"] = measure_saved(args)
    result["step_time_1rank"] = measure_step_time(args, t=1)
    result["seconds"] = time.perf_counter() - started
    _report(result, args)
    from megatron_lora import runtime

    runtime.shutdown()


def _report(result, args):
    print(f"# LoRA on megatron linears: h={args.hidden} ffn={args.ffn} r={args.rank} "
          f"tokens={args.tokens} fp32")
    rows = result.get("collectives", [])
    if rows:
        print("\n## 1. LoRA-added collective bytes per layer per step, TP=2")
        print("| layout | LoRA-added calls | bytes | hidden-sized bytes | analytic minimum |")
        print("|---|---|---|---|---|")
        for row in rows:
            print(f"| {row['layout']} | {', '.join(row['lora_calls'])} | {row['lora_bytes']} | "
                  f"{row['hidden_bytes']} | {row['analytic_min_bytes']} |")
    print("\n## 2. Saved-for-backward bytes per token, one rank")
    print("| layer | dropout | frozen base | extra with LoRA | LoRA saves |")
    print("|---|---|---|---|---|")
    for name, row in result["saved"].items():
        layer, p = name.split(" p=")
        print(f"| {layer} | {p} | {row['frozen_base_bytes_per_token']:.0f} | "
              f"{row['extra_bytes_per_token']:.2f} | {', '.join(row['saved'])} |")
    print(f"\n## 3. Step time (forward+backward of fc1 -> SiLU -> fc2), best of {args.reps}, "
          "one torch thread per rank")
    print("| ranks | clock | frozen s | LoRA s | full fine-tune s | LoRA/frozen | LoRA/full |")
    print("|---|---|---|---|---|---|---|")
    for label, key in (("1", "step_time_1rank"), ("TP=2 + SP", "step_time_tp2_sp")):
        if key in result:
            st = result[key]
            for clock in ("cpu", "wall"):
                s = st[f"{clock}_seconds"]
                print(f"| {label} | {clock} | {s['frozen']:.3f} | {s['lora']:.3f} | "
                      f"{s['full']:.3f} | {st[clock + '_lora_over_frozen']:.3f} | "
                      f"{st[clock + '_lora_over_full']:.3f} |")
    column_in = f"column(in={args.hidden})"
    summary = {
        "hidden_collective_bytes": sum(r["hidden_bytes"] for r in rows) if rows else None,
        "lora_collective_bytes_over_analytic_min": (
            sum(r["lora_bytes"] for r in rows) / sum(r["analytic_min_bytes"] for r in rows)
            if rows else None),
        "extra_saved_bytes_per_token_dropout0":
            result["saved"][f"{column_in} p=0.0"]["extra_bytes_per_token"],
        "extra_saved_bytes_per_token_dropout01":
            result["saved"][f"{column_in} p=0.1"]["extra_bytes_per_token"],
        # single rank, process CPU time (see measure_step_time); wall-clock ratios beside them
        "lora_over_frozen": round(result["step_time_1rank"]["cpu_lora_over_frozen"], 4),
        "lora_over_full": round(result["step_time_1rank"]["cpu_lora_over_full"], 4),
        "wall_lora_over_frozen": round(result["step_time_1rank"]["wall_lora_over_frozen"], 4),
        "wall_lora_over_full": round(result["step_time_1rank"]["wall_lora_over_full"], 4),
        "tp2": ({k: round(v, 4) for k, v in result["step_time_tp2_sp"].items() if "over" in k}
                if "step_time_tp2_sp" in result else None),
        "shape": result["shape"],
        "seconds": round(result["seconds"], 1),
    }
    print()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
