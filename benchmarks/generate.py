"""Benchmark: time per generated token at 32 and 256 new tokens, with the KV cache (and without).

    .venv/bin/python benchmarks/generate.py      # about 1.5 minutes on 2 CPU cores

Model: a small Mixtral shape (4 layers, h=256, 8 heads / 4 query groups, 8 experts top-2, ffn
512, vocabulary 1024), LoRA r=8 on linear_qkv, linear_proj and every expert's linear_fc1 /
linear_fc2 (non-zero factors), fp32, one rank on CPU (or the GPU when CUDA is usable), the SDPA
core attention that `megatron-lora generate` uses. A 16-token prompt is extended greedily by
`megatron_lora.inference.generate` (the command's engine: megatron's forward-only schedule and a
StaticInferenceContext). ms per token = the whole call's time (prefill included) / new tokens,
best of --reps calls after a warm-up call.

`kv_cache_ms_per_token_ratio_256_vs_32` = ms/token at 256 new tokens / ms/token at 32 (target
<= 1.5: flat time per token). For contrast, the same greedy loop without a cache (the whole
sequence through the model at every step, one call each size) grows with the output. The last
line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _no_cache(model, prompt, new_tokens, device):
    """Greedy without a cache: the whole sequence through the model for every new token."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            tokens = torch.tensor([ids], device=device)
            positions = torch.arange(len(ids), device=device).unsqueeze(0)
            logits = model(tokens, positions, attention_mask=None)
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def measure(sizes=(32, 256), reps: int = 3, no_cache: bool = True) -> dict:
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import torch

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    from megatron_lora import runtime
    from megatron_lora.inference import SamplingConfig, generate
    from megatron_lora.lora.model import LoraConfig, apply_lora
    from megatron_lora.models.gpt import build_gpt_model, tiny_moe_shape, transformer_config

    runtime.init_process_group()
    layout = runtime.ParallelLayout()
    runtime.initialize(layout, seed=1)
    results = {}
    try:
        shape = tiny_moe_shape(vocab_size=1024, hidden_size=256, ffn_hidden_size=512,
                                   num_attention_heads=8, num_query_groups=4, num_experts=8,
                                   max_position_embeddings=PROMPT + max(sizes) + 8)
        model = build_gpt_model(shape, transformer_config(shape, layout), attention_backend="flash")
        apply_lora(model, LoraConfig(r=8, lora_alpha=16.0, init_lora_weights=False, seed=2,
                                     target_modules=["linear_qkv", "linear_proj", "linear_fc1",
                                                     "linear_fc2"]), verbose=False)
        device = runtime.device()
        model.to(device).eval()
        prompt = torch.randint(0, shape.vocab_size, (PROMPT,),
                               generator=torch.Generator().manual_seed(3)).tolist()
        # Warm-up (first calls allocate and pick kernels), not timed.
        generate(model, prompt, SamplingConfig(max_new_tokens=4), eos_id=None,
                 vocab_size=shape.vocab_size)
        _no_cache(model, prompt, 4, device)
        for n in sizes:
            config = SamplingConfig(max_new_tokens=n)
            times, out = [], None
            for _ in range(reps):
                start = time.perf_counter()
                out = generate(model, prompt, config, eos_id=None, vocab_size=shape.vocab_size)
                times.append(time.perf_counter() - start)
            results[f"kv_cache_ms_per_token_{n}"] = 1000.0 * min(times) / n
            if no_cache:
                start = time.perf_counter()
                plain = _no_cache(model, prompt, n, device)
                results[f"no_cache_ms_per_token_{n}"] = 1000.0 * (time.perf_counter() - start) / n
                # The same greedy tokens: the cache changes the cost, not the result.
                results[f"same_tokens_{n}"] = plain == out
    finally:
        runtime.shutdown()
    small, large = sizes
    results["kv_cache_ms_per_token_ratio_256_vs_32"] = (
        results[f"kv_cache_ms_per_token_{large}"] / results[f"kv_cache_ms_per_token_{small}"])
    if no_cache:
        results["no_cache_ms_per_token_ratio_256_vs_32"] = (
            results[f"no_cache_ms_per_token_{large}"] / results[f"no_cache_ms_per_token_{small}"])
    results.update(prompt_tokens=PROMPT, reps=reps,
                   device="cuda" if torch.cuda.is_available() else "cpu")
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-baseline", action="store_true", help="skip the run without a cache")
    args = p.parse_args(argv)
    r = measure(reps=args.reps, no_cache=not args.no_baseline)
    print(f"{'new tokens':>10} {'KV cache ms/token':>18} {'no cache ms/token':>18}")
    for n in (32, 256):
        base = r.get(f"no_cache_ms_per_token_{n}")
        print(f"{n:>10} {r[f'kv_cache_ms_per_token_{n}']:18.1f} "
              f"{'-' if base is None else f'{base:.1f}':>18}")
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
