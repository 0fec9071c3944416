"""Benchmark of an NF4 frozen base (--base-quantization nf4): what the ranks hold and what it costs.

    .venv/bin/python benchmarks/qlora.py          # about 1-2 minutes on 2 CPU cores

A 2-layer MoE GPT (h=512, 8 experts of ffn 512, top-2, GQA) at EP2 on 2 gloo ranks, bf16:
1. frozen_bytes_per_param: the bytes the ranks actually hold for the frozen decoder linears
   (NF4 codes, block scales, second-level scales: every buffer of every NF4 linear, both ranks)
   over the parameters they stand for. QLoRA's format gives 0.5 + 1/64 + 4/16384 ~ 0.516;
   target <= 0.53.
2. step_time_vs_bf16_base: one LoRA training step's forward + backward (adapters on attention
   and experts, r=16), NF4 base over the same model with its bf16 base, same layout and tokens
   (best wall time of interleaved runs, rank 0, after a barrier). On CPU dequantisation is plain
   torch per GEMM; the ratio says what holding the base in 4 bits costs in time there.
Ends with one JSON line: frozen_bytes_per_param, step_time_vs_bf16_base (and the two times).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORLD = 2
SEQ, BATCH, RANK = 128, 2, 16


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(layout, nf4: bool):
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.models.gpt import build_gpt_model, tiny_moe_shape, transformer_config
    from megatron_lora.models.nf4_model import quantize_base

    shape = tiny_moe_shape(vocab_size=512, hidden_size=512, ffn_hidden_size=512, num_layers=2,
                           num_attention_heads=8, num_query_groups=2, num_experts=8)
    torch.manual_seed(0)
    model = build_gpt_model(shape, transformer_config(shape, layout, dtype=torch.bfloat16))
    if nf4:
        quantize_base(model)
    apply_lora(model, LoraConfig(r=RANK, lora_alpha=32, seed=1, init_lora_weights=False,
                                 target_modules=["linear_qkv", "linear_proj", "linear_fc1",
                                                 "linear_fc2"]), verbose=False)
    return model


def _step(model, tokens):
    position_ids = torch.arange(SEQ).expand_as(tokens)
    loss = model(tokens, position_ids, attention_mask=None, labels=tokens)
    loss.float().mean().backward()


def _worker(rank, port, path, reps):
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from megatron_lora import runtime
    from megatron_lora.models.nf4_model import nf4_held
    from megatron_lora.runtime import ParallelLayout

    runtime.initialize(ParallelLayout(ep=2), seed=1234, backend="gloo")
    layout = ParallelLayout(ep=2)
    models = {"bf16": _model(layout, False), "nf4": _model(layout, True)}
    held = torch.tensor(nf4_held(models["nf4"]), dtype=torch.float64)
    dist.all_reduce(held)
    tokens = torch.randint(0, 512, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
    best = {name: float("inf") for name in models}
    for name, model in models.items():
        _step(model, tokens)  # warm-up
    for _ in range(reps):
        for name, model in models.items():  # interleaved: machine noise hits both alike
            dist.barrier()
            t0 = time.perf_counter()
            _step(model, tokens)
            dist.barrier()
            best[name] = min(best[name], time.perf_counter() - t0)
    if rank == 0:
        with open(path, "w") as f:
            json.dump({"held_bytes": held[0].item(), "params": held[1].item(), **best}, f)
    runtime.shutdown()


def main(argv=None):
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3, help="timed steps per base (best is kept)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(_free_port(), path, args.reps), nprocs=WORLD, join=True)
        with open(path) as f:
            r = json.load(f)
    print(f"NF4 decoder linears: {r['held_bytes'] / 2**20:.2f} MiB held for "
          f"{r['params'] / 1e6:.2f} M parameters over {WORLD} ranks (EP2)")
    print(f"LoRA step (forward + backward): bf16 base {r['bf16']:.3f} s, NF4 base "
          f"{r['nf4']:.3f} s")
    summary = {"frozen_bytes_per_param": round(r["held_bytes"] / r["params"], 4),
               "step_time_vs_bf16_base": round(r["nf4"] / r["bf16"], 3),
               "step_s_bf16_base": round(r["bf16"], 4), "step_s_nf4_base": round(r["nf4"], 4)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
