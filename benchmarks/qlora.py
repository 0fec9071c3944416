"""Benchmark of an NF4 frozen base (--base-quantization nf4): what the ranks hold and what it costs.

    .venv/bin/python benchmarks/qlora.py          # about 3-4 minutes on 2 CPU cores
    .venv/bin/python benchmarks/qlora.py --load-only   # part 3 alone, about 2 minutes

A 2-layer MoE GPT (h=512, 8 experts of ffn 512, top-2, GQA) at EP2 on 2 gloo ranks, bf16:
1. frozen_bytes_per_param: the bytes the ranks actually hold for the frozen decoder linears
   (NF4 codes, block scales, second-level scales: every buffer of every NF4 linear, both ranks)
   over the parameters they stand for. QLoRA's format gives 0.5 + 1/64 + 4/16384 ~ 0.516;
   target <= 0.53.
2. step_time_vs_bf16_base: one LoRA training step's forward + backward (adapters on attention
   and experts, r=16), NF4 base over the same model with its bf16 base, same layout and tokens
   (best wall time of interleaved runs, rank 0, after a barrier). On CPU dequantisation is plain
   torch per GEMM; the ratio says what holding the base in 4 bits costs in time there.
3. peak_load_bytes: building the model and loading its base, in a fresh one-rank process per
   mode, on a bigger MoE (h=1024, 8 experts of ffn 1024, 4 layers, vocab 4096, bf16: 239 MB)
   from a synthetic bf16 HF checkpoint: how much the process's peak RSS grows over its RSS
   before the build (the peak reset first: /proc/self/clear_refs). Modes: the bf16 base
   (peak_load_bytes_bf16_base), the NF4 base streamed (build_base: each linear read, quantised,
   dropped; peak_load_bytes) and loading in bf16 then quantize_base (the way before streaming;
   peak_load_bytes_nf4_after_load), with what the model holds after (model_bytes_*) and one
   layer's decoder linears in bf16 (layer_linear_bytes_bf16): streaming's peak should be about
   model_bytes_nf4 plus one linear's transient, well under the bf16 model.
Ends with one JSON line: frozen_bytes_per_param, step_time_vs_bf16_base (and the two times),
the peak_load_bytes figures (--no-load skips part 3, --load-only runs only it).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
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


LOAD_MODEL = dict(hidden_size=1024, intermediate_size=1024, num_local_experts=8,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=4096)
LOAD_LAYERS = 4
LOAD_MODES = ("bf16_base", "nf4", "nf4_after_load")


def _rss_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _load_child(mode: str, hf_dir: str) -> dict:
    """One rank in this (fresh) process: build the model and load its bf16 base from hf_dir as
    `mode` says; the peak RSS growth over the RSS before the build, and what the model holds."""
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    torch.set_num_threads(1)
    from megatron_lora import runtime
    from megatron_lora.cli.model_setup import build_base
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.models.build import model_config
    from megatron_lora.models.nf4 import code_books
    from megatron_lora.models.nf4_model import quantize_base
    from megatron_lora.runtime import ParallelLayout

    code_books("cpu")  # bitsandbytes loaded, as the commands' checks load it before building
    layout = ParallelLayout()
    runtime.initialize(layout, seed=0, backend="gloo")
    info, hf, _ = open_hf(hf_dir)
    config = model_config(info, layout, dtype=torch.bfloat16)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    before = _rss_status("VmRSS")
    model = build_base(info, config, hf=hf, base_quantization="nf4" if mode == "nf4" else "none",
                       use_te=False, moe_grouped_gemm=False)
    if mode == "nf4_after_load":
        quantize_base(model)
    peak = _rss_status("VmHWM")
    storages = {}
    for t in list(model.parameters()) + list(model.buffers()):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    layer = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if n.startswith("decoder.layers.0.") and ".linear_" in n and "norm" not in n)
    runtime.shutdown()
    return {"peak_growth": peak - before, "held": sum(storages.values()), "layer_linears": layer}


def measure_load() -> dict:
    """Part 3 (see the module docstring): one fresh process per mode."""
    from tools.make_synthetic_mixtral import make

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = os.path.join(tmp, "hf")
        make(hf_dir, LOAD_LAYERS, 2 ** 31, **LOAD_MODEL)
        for mode in LOAD_MODES:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), "--load-child", mode,
                                   "--hf", hf_dir], capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"load measurement {mode} failed:\n{done.stderr[-3000:]}")
            out[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    mib = 2 ** 20
    for mode in LOAD_MODES:
        print(f"build + load ({mode}): peak RSS +{out[mode]['peak_growth'] / mib:.1f} MiB, "
              f"model holds {out[mode]['held'] / mib:.1f} MiB")
    return {"peak_load_bytes": out["nf4"]["peak_growth"],
            "peak_load_bytes_bf16_base": out["bf16_base"]["peak_growth"],
            "peak_load_bytes_nf4_after_load": out["nf4_after_load"]["peak_growth"],
            "model_bytes_bf16": out["bf16_base"]["held"], "model_bytes_nf4": out["nf4"]["held"],
            "layer_linear_bytes_bf16": out["bf16_base"]["layer_linears"]}


def main(argv=None):
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3, help="timed steps per base (best is kept)")
    p.add_argument("--no-load", action="store_true", help="skip the build + load peak (part 3)")
    p.add_argument("--load-only", action="store_true", help="only the build + load peak")
    p.add_argument("--load-child", choices=LOAD_MODES, help=argparse.SUPPRESS)
    p.add_argument("--hf", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.load_child:
        print(json.dumps(_load_child(args.load_child, args.hf)))
        return 0
    if args.load_only:
        print(json.dumps(measure_load()))
        return 0
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
    if not args.no_load:
        summary.update(measure_load())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
