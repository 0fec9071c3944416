"""Step time of adapter variants against plain LoRA on the small Mixtral, CPU, one process.

    .venv/bin/python benchmarks/adapters.py [--hidden 512] [--steps 4] [--reps 3]

Builds the small Mixtral of benchmarks/train.py (HF safetensors, loaded into megatron-core at
world size 1, fp32), applies LoRA (r=16, alpha=32, q/k/v/o and every expert's fc1/fc2) and the
same adapter with DoRA (`use_dora`, train --lora-use-dora) and prefix tuning instead of LoRA
(`--virtual-tokens` 20 per layer, train --peft-type prefix), and times one training step
(forward + backward + AdamW) of each on the same token batches. The models alternate `--reps`
times and each keeps its best step, which keeps the ratios meaningful on a shared machine.

Memory per adapter parameter for each --lora-dtype (fp32, bf16, fp16): the same LoRA built in
that dtype takes one optimizer step, then the real tensors are measured: the parameters, their
DDP gradient buffers (`main_grad`), the optimizer's fp32 master copies (half adapters only) and
Adam's two moments, each as bytes / adapter parameters.

Ends with one JSON line: `dora_over_lora` (target <= 1.3), `prefix_over_lora` and the seconds
behind them, and
`bytes_per_adapter_param` {dtype: {param, grad, master, adam, total}} (target: param 2 for bf16,
the optimizer's state fp32).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def _build(hf_dir: str, use_dora: bool, targets, dtype=None, virtual_tokens: int = 0):
    from megatron_lora.convert.hf_to_mcore import open_hf
    from megatron_lora.convert.load import load_hf
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.models.build import build_model, model_config
    from megatron_lora.runtime import ParallelLayout
    from megatron_lora.training.optimizer import OptimConfig, wrap_for_training

    info, hf, _ = open_hf(hf_dir)
    model = build_model(info, model_config(info, ParallelLayout()))
    load_hf(model, info, hf)
    if virtual_tokens:  # prefix tuning (train --peft-type prefix), PEFT's defaults otherwise
        config = LoraConfig(num_virtual_tokens=virtual_tokens, target_modules=(), dtype=dtype)
    else:
        config = LoraConfig(r=16, lora_alpha=32, target_modules=targets, use_dora=use_dora,
                            dtype=dtype)
    apply_lora(model, config, verbose=False)
    wrapped, optimizer, _ = wrap_for_training([model], OptimConfig(lr=1e-4, train_iters=100,
                                                                    lr_decay_style="constant"))
    return info, wrapped, optimizer


def _step_time(wrapped, optimizer, data, batch: int) -> float:
    from megatron_lora.training.step import forward_backward

    best = float("inf")
    for rows in data:
        start = time.perf_counter()
        wrapped[0].zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(wrapped, rows[:, :-1], rows[:, 1:], micro_batch_size=batch)
        optimizer.step()
        best = min(best, time.perf_counter() - start)
    return best


def _bytes_per_param(hf_dir: str, dtype: str, targets, data, batch: int) -> dict:
    """{param, grad, master, adam, total}: bytes per adapter parameter after one optimizer step
    of LoRA in `dtype` (a skipped fp16 step, an overflow of the first loss scale, is retried)."""
    from megatron_lora.lora.model import get_adapter_params
    from megatron_lora.training.checkpoint import _param_pairs
    from megatron_lora.training.step import forward_backward

    _, wrapped, optimizer = _build(hf_dir, False, targets, dtype)
    for rows in data * 3:
        wrapped[0].zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(wrapped, rows[:, :-1], rows[:, 1:], micro_batch_size=batch)
        if optimizer.step()[0]:
            break
    params = {id(p): p for p in get_adapter_params(wrapped[0].module).values()}
    count = sum(p.numel() for p in params.values())
    sizes = {"param": 0, "grad": 0, "master": 0, "adam": 0}
    for inner, model_p, main_p in _param_pairs(optimizer):
        if id(model_p) not in params:
            continue
        sizes["param"] += model_p.numel() * model_p.element_size()
        sizes["grad"] += model_p.main_grad.numel() * model_p.main_grad.element_size()
        if main_p is not model_p:
            sizes["master"] += main_p.numel() * main_p.element_size()
        state = inner.state[main_p]
        sizes["adam"] += sum(state[k].numel() * state[k].element_size()
                             for k in ("exp_avg", "exp_avg_sq"))
    out = {k: round(v / count, 3) for k, v in sizes.items()}
    out["total"] = round(sum(sizes.values()) / count, 3)
    out["adapter_params"] = count
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--virtual-tokens", type=int, default=20,
                   help="prefix length of the prefix-tuning model (PEFT's num_virtual_tokens)")
    p.add_argument("--targets", nargs="+",
                   default=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    args = p.parse_args(argv)

    import torch

    from benchmarks.train import batches, make_model
    from megatron_lora import runtime
    from megatron_lora.cli.common import torchrun_env_defaults
    from megatron_lora.runtime import ParallelLayout

    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    torchrun_env_defaults(29547)
    runtime.initialize(ParallelLayout(), seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        make_model(tmp, args.hidden, args.layers, args.experts, args.vocab)
        info, lora_model, lora_opt = _build(tmp, False, args.targets)
        _, dora_model, dora_opt = _build(tmp, True, args.targets)
        _, prefix_model, prefix_opt = _build(tmp, False, (), virtual_tokens=args.virtual_tokens)
        data = batches(info.vocab_size, args.batch, args.seq, args.steps)
        per_param = {d: _bytes_per_param(tmp, d, args.targets, data[:1], args.batch)
                     for d in ("fp32", "bf16", "fp16")}
    _step_time(lora_model, lora_opt, data[:1], args.batch)  # warm-up
    _step_time(dora_model, dora_opt, data[:1], args.batch)
    _step_time(prefix_model, prefix_opt, data[:1], args.batch)
    lora_s = dora_s = prefix_s = float("inf")
    for _ in range(args.reps):
        lora_s = min(lora_s, _step_time(lora_model, lora_opt, data, args.batch))
        dora_s = min(dora_s, _step_time(dora_model, dora_opt, data, args.batch))
        prefix_s = min(prefix_s, _step_time(prefix_model, prefix_opt, data, args.batch))
    result = {
        "dora_over_lora": round(dora_s / lora_s, 4),
        "prefix_over_lora": round(prefix_s / lora_s, 4),
        "lora_step_s": round(lora_s, 4),
        "dora_step_s": round(dora_s, 4),
        "prefix_step_s": round(prefix_s, 4),
        "virtual_tokens": args.virtual_tokens,
        "bytes_per_adapter_param": per_param,
        "shape": {"hidden": args.hidden, "layers": args.layers, "experts": args.experts,
                  "tokens": args.batch * args.seq, "rank": 16, "dtype": "float32",
                  "threads": args.threads, "targets": args.targets},
        "seconds": round(time.perf_counter() - began, 1),
    }
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
