"""Benchmark: the optimizer step (gradient norm, clipping, Adam) over many small trainable tensors,
the package's (training/grad_norm.py, torch's foreach AdamW on CPU) against megatron-core's own
fallback without TE/apex (per-tensor norms read on the host, torch's default AdamW).

    python benchmarks/optimizer_step.py                       # 10, 100, 1000 tensors of [16, 16]
    python benchmarks/optimizer_step.py --counts 1032 --reps 20

One rank (gloo, in this process), fp32, half the tensors expert parameters (megatron's expert
sub-optimizer, as LoRA on experts makes), clipping on (max norm 1e-3, so every step clips). For
each count: host reads of device values per step under testing/device_check.py (each a stream
synchronisation on a GPU; machine-independent), then the step's wall time, best of --reps,
the two optimizers interleaved. The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_world() -> None:
    from megatron_lora import runtime

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    runtime.initialize(runtime.ParallelLayout())


def build(count: int, shape, megatrons: bool):
    """A module of `count` trainable [shape] tensors (odd ones expert parameters) and an
    optimizer over it: the package's, or megatron's ChainedOptimizer over the same
    sub-optimizers with torch's default Adam kernels."""
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.transformer.module import MegatronModule

    from megatron_lora import runtime
    from megatron_lora.models.gpt import tiny_moe_shape, transformer_config
    from megatron_lora.training.optimizer import OptimConfig, wrap_for_training

    class Tensors(MegatronModule):
        def __init__(self, config):
            super().__init__(config)
            g = torch.Generator().manual_seed(count)
            self.weights = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(*shape, generator=g).to(runtime.device()))
                for _ in range(count))
            for k, p in enumerate(self.weights):
                p.allreduce = k % 2 == 0  # False: megatron's expert parameter

    config = transformer_config(tiny_moe_shape(), runtime.ParallelLayout())
    _, optimizer, _ = wrap_for_training([Tensors(config)], OptimConfig(clip_grad=1e-3))
    if megatrons:
        optimizer = ChainedOptimizer(optimizer.chained_optimizers)
        for sub in optimizer.chained_optimizers:
            for group in sub.optimizer.param_groups:
                group["fused"] = group["foreach"] = None
    return optimizer


def fill(optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for sub in optimizer.chained_optimizers:
        for p in sub.get_parameters():
            p.main_grad.copy_(torch.randn(p.main_grad.shape, generator=g))


def host_reads(count: int, shape, megatrons: bool) -> int:
    """Host reads of device values in the second step (the first makes Adam's state)."""
    from megatron_lora.testing.device_check import DeviceCheck

    with DeviceCheck() as check:
        optimizer = build(count, shape, megatrons)
        for k in range(2):
            fill(optimizer, k)
            before = len(check.reads)
            optimizer.step()
    if check.errors:
        raise SystemExit(f"optimizer_step.py: {check.errors}")
    return len(check.reads) - before


def step_times(count: int, shape, reps: int) -> dict:
    """Best wall time (s) of a step, each optimizer, interleaved; also of the norm alone."""
    optimizers = {"megatron": build(count, shape, True), "package": build(count, shape, False)}
    best = {f"{kind}_{name}": float("inf") for name in optimizers for kind in ("step", "norm")}
    for rep in range(reps + 1):  # the first step makes Adam's state: not timed
        for name, optimizer in optimizers.items():
            fill(optimizer, rep)
            t0 = time.perf_counter()
            optimizer.step()
            t1 = time.perf_counter()
            optimizer.prepare_grads()
            t2 = time.perf_counter()
            optimizer.get_grad_norm()
            t3 = time.perf_counter()
            if rep:
                best[f"step_{name}"] = min(best[f"step_{name}"], t1 - t0)
                best[f"norm_{name}"] = min(best[f"norm_{name}"], t3 - t2)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--counts", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--shape", type=int, nargs=2, default=[16, 16])
    p.add_argument("--reps", type=int, default=10, help="timed steps per optimizer")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    _start_world()
    rows = []
    for count in args.counts:
        row = {"tensors": count,
               "reads_megatron": host_reads(count, args.shape, True),
               "reads_package": host_reads(count, args.shape, False)}
        row.update(step_times(count, args.shape, args.reps))
        row["step_ratio"] = row["step_package"] / row["step_megatron"]
        row["norm_ratio"] = row["norm_package"] / row["norm_megatron"]
        rows.append(row)
    print(f"{'tensors':>7} | {'host reads/step: megatron':>25} {'package':>7} | "
          f"{'step ms: megatron':>17} {'package':>7} {'ratio':>5} | "
          f"{'norm ms: megatron':>17} {'package':>7} {'ratio':>5}")
    for r in rows:
        print(f"{r['tensors']:7d} | {r['reads_megatron']:25d} {r['reads_package']:7d} | "
              f"{1e3 * r['step_megatron']:17.2f} {1e3 * r['step_package']:7.2f} "
              f"{r['step_ratio']:5.2f} | {1e3 * r['norm_megatron']:17.2f} "
              f"{1e3 * r['norm_package']:7.2f} {r['norm_ratio']:5.2f}")
    print(json.dumps({"shape": args.shape, "reps": args.reps, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
