"""LoRA training throughput: megatron-lora vs Hugging Face transformers + PEFT, side by side.

    .venv/bin/python benchmarks/train.py [--hidden 512] [--steps 6] [--reps 2]

Both sides train the same small Mixtral (the same HF safetensors), on the same token batches, with
LoRA on the same modules (by default q/k/v/o projections and every expert's fc1/fc2: w1/w3/w2, or
transformers 5's fused gate_up_proj/down_proj through PEFT's target_parameters; see --targets),
ours with its default experts module (SequentialMLP on CPU, grouped experts on CUDA), fp32,
world size 1, AdamW. Each side runs in its own process (so peak RSS is its own); sides alternate `--reps` times and the best tokens/s of each is kept, which
keeps the ratio meaningful on a noisy machine. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def make_model(directory: str, hidden: int, layers: int, experts: int, vocab: int) -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 7 // 2,
                        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                        num_local_experts=experts, num_experts_per_tok=2,
                        max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False)
    MixtralForCausalLM(cfg).float().save_pretrained(directory, max_shard_size="200MB")


def batches(vocab: int, batch: int, seq: int, steps: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (batch, seq + 1), generator=g) for _ in range(steps)]


def add_model_args(p, steps: int) -> None:
    """The model, batch and LoRA flags this benchmark and step_profile.py share."""
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--targets", nargs="+",
                   default=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])


def build_ours(args, port: int = 29541):
    """(info, wrapped model chunks, optimizer): the small Mixtral at args.hf, LoRA on
    args.targets, megatron-core's DDP and optimizer, world size 1 (also step_profile.py's)."""
    from megatron_lora import runtime
    from megatron_lora.cli.common import torchrun_env_defaults
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.models.build import build_model, model_config
    from megatron_lora.runtime import ParallelLayout
    from megatron_lora.training.optimizer import OptimConfig, wrap_for_training

    torchrun_env_defaults(port)
    layout = ParallelLayout()
    runtime.initialize(layout, seed=0)
    info, hf, _ = open_hf(args.hf)
    model = build_model(info, model_config(info, layout))
    load_hf(model, info, hf)
    apply_lora(model, LoraConfig(r=16, lora_alpha=32, target_modules=args.targets), verbose=False)
    wrapped, optimizer, _ = wrap_for_training([model], OptimConfig(lr=1e-4, train_iters=100,
                                                                    lr_decay_style="constant"))
    return info, wrapped, optimizer


def run_ours(args) -> dict:
    from megatron_lora.training.step import forward_backward

    info, wrapped, optimizer = build_ours(args)
    data = batches(info.vocab_size, args.batch, args.seq, args.steps + 1)
    times = []
    for step, rows in enumerate(data):
        start = time.perf_counter()
        wrapped[0].zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(wrapped, rows[:, :-1], rows[:, 1:], micro_batch_size=args.batch)
        optimizer.step()
        if step:  # the first step warms up
            times.append(time.perf_counter() - start)
    return {"step_s": min(times)}


def run_peft(args) -> dict:
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import MixtralForCausalLM

    hf_targets = {"linear_qkv": ["q_proj", "k_proj", "v_proj"], "linear_proj": ["o_proj"],
                  "linear_fc1": ["w1", "w3"], "linear_fc2": ["w2"]}
    # transformers 5 fuses each layer's experts into 3-D parameters; PEFT adapts those through
    # target_parameters (one LoRA pair per expert), older releases have w1/w2/w3 linears.
    fused = {"linear_fc1": "mlp.experts.gate_up_proj", "linear_fc2": "mlp.experts.down_proj"}
    model = MixtralForCausalLM.from_pretrained(args.hf, dtype=torch.float32)
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    experts_fused = "w1" not in names
    targets = [t for k in args.targets if not (experts_fused and k in fused)
               for t in hf_targets[k]]
    parameters = [fused[k] for k in args.targets if experts_fused and k in fused]
    extra = {"target_parameters": parameters} if parameters else {}
    model = get_peft_model(model, PeftLoraConfig(r=16, lora_alpha=32, target_modules=targets,
                                                 **extra))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    data = batches(model.config.vocab_size, args.batch, args.seq, args.steps + 1)
    times = []
    for step, rows in enumerate(data):
        start = time.perf_counter()
        optimizer.zero_grad()
        inputs = rows[:, :-1]
        out = model(input_ids=inputs, labels=inputs)  # transformers shifts labels itself
        out.loss.backward()
        optimizer.step()
        if step:
            times.append(time.perf_counter() - start)
    return {"step_s": min(times)}


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    result = run_ours(args) if args.side == "ours" else run_peft(args)
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, steps=6)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--side", choices=["ours", "peft"], default=None)
    p.add_argument("--hf", default=None)
    args = p.parse_args()
    if args.side:
        child(args)
        return
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        hf = os.path.join(tmp, "hf")
        make_model(hf, args.hidden, args.layers, args.experts, args.vocab)
        best = {}
        for rep in range(args.reps):
            for side in ("ours", "peft"):
                cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--hf", hf]
                for k in ("hidden", "batch", "seq", "steps", "threads"):
                    cmd += [f"--{k}", str(getattr(args, k))]
                cmd += ["--targets", *args.targets]
                env = dict(os.environ, PYTHONWARNINGS="ignore")
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
                if out.returncode or line is None:
                    sys.exit(f"{side} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
                r = json.loads(line[len("RESULT "):])
                prev = best.get(side)
                if prev is None or r["step_s"] < prev["step_s"]:
                    best[side] = r
                else:
                    best[side]["peak_rss_bytes"] = max(prev["peak_rss_bytes"], r["peak_rss_bytes"])
    tokens = args.batch * args.seq
    ours, peft = tokens / best["ours"]["step_s"], tokens / best["peft"]["step_s"]
    print(f"Mixtral h={args.hidden}, {args.layers} layers, {args.experts} experts top-2, vocab "
          f"{args.vocab}, batch {args.batch}x{args.seq}, LoRA r=16 on {' '.join(args.targets)}, "
          f"fp32, {args.threads} threads, best of {args.steps} steps x {args.reps} runs")
    print(f"{'':14}{'tokens/s':>10}{'peak RSS (MiB)':>16}")
    print(f"{'megatron-lora':14}{ours:10.0f}{best['ours']['peak_rss_bytes'] / 2**20:16.0f}")
    print(f"{'HF PEFT':14}{peft:10.0f}{best['peft']['peak_rss_bytes'] / 2**20:16.0f}")
    print(json.dumps({
        "tokens_per_s": round(ours, 1), "peft_tokens_per_s": round(peft, 1),
        "ratio_vs_peft": round(ours / peft, 3),
        "peak_rss_bytes": best["ours"]["peak_rss_bytes"],
        "peft_peak_rss_bytes": best["peft"]["peak_rss_bytes"],
        "hidden": args.hidden, "targets": args.targets, "seconds": round(time.time() - started, 1),
    }))


if __name__ == "__main__":
    main()
