"""Benchmark: how the peak memory of one attention layer's forward+backward grows with s.

    .venv/bin/python benchmarks/attention.py      # h=512, 8 heads, 2 query groups, b=1, fp32

The layer is megatron-core's SelfAttention from the local spec (linear_qkv, core attention,
linear_proj; no RoPE), one rank, with its core attention either `SDPAttention` (attention
backend 'flash') or megatron's `DotProductAttention` ('unfused'). Each (backend, mask, s) runs
in a fresh process: it builds the layer and its input, resets the process's peak-RSS mark
(/proc/self/clear_refs), runs forward+backward once and reports peak RSS minus the RSS before.
glibc's malloc is told to serve every large block by mmap (MALLOC_MMAP_THRESHOLD_), so freed
tensors leave the RSS at once and the peak counts live tensors only. Best (lowest) of --reps
processes per configuration.

The last line printed is one JSON object: attention_memory_growth_per_doubling (SDPAttention,
causal, peak at s=2*S over peak at s=S, S=--seq 2048), unfused_attention_memory_growth_per_doubling
(DotProductAttention, same), packed_attention_memory_growth_per_doubling (SDPAttention with a
packed [b, 1, s, s] boolean mask: two samples per row), plus the peaks in bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(backend: str, packed: bool, seq: int, hidden: int, heads: int, groups: int) -> int:
    """Peak bytes above the starting RSS of one fwd+bwd of the layer (runs in its own process)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import gc

    import torch

    torch.set_num_threads(1)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))
    from megatron.core.transformer.spec_utils import build_module

    from megatron_lora import runtime
    from megatron_lora.models.gpt import ModelShape, transformer_config
    from megatron_lora.models.specs import local_layer_spec
    from megatron_lora.runtime import ParallelLayout

    runtime.initialize(ParallelLayout(), seed=1234, backend="gloo")
    shape = ModelShape(num_layers=1, hidden_size=hidden, ffn_hidden_size=4 * hidden,
                       num_attention_heads=heads, num_query_groups=groups,
                       vocab_size=128, max_position_embeddings=seq)
    config = transformer_config(shape, ParallelLayout())
    spec = local_layer_spec(attention_backend=backend).submodules.self_attention
    layer = build_module(spec, config=config, layer_number=1)
    x = torch.randn(seq, 1, hidden, requires_grad=True)
    mask = None
    if packed:  # two samples: [0, s/2) and [s/2, s), causal within each; True = masked
        sid = (torch.arange(seq) >= seq // 2).long()
        allowed = (sid[:, None] == sid[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril()
        mask = (~allowed)[None, None]
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _rss_kb("VmRSS")
    out, _ = layer(x, attention_mask=mask)
    out.sum().backward()
    return (_rss_kb("VmHWM") - before) * 1024


def _measure(backend, packed, seq, args) -> int:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", backend, str(int(packed)),
           str(seq), str(args.hidden), str(args.heads), str(args.groups)]
    best = None
    for _ in range(args.reps):
        for _attempt in range(3):  # a free port can be taken before the child binds it
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
            if out.returncode == 0 or "EADDRINUSE" not in out.stderr:
                break
        if out.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
        peak = int(out.stdout.strip().splitlines()[-1])
        best = peak if best is None else min(best, peak)
    return best


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        b, p, s, h, n, g = sys.argv[2:8]
        print(child(b, bool(int(p)), int(s), int(h), int(n), int(g)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=2048, help="S: compares s=S with s=2S")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="fresh processes per configuration")
    args = ap.parse_args(argv)
    result = {}
    for key, backend, packed in (("attention", "flash", False), ("unfused_attention", "unfused",
                                 False), ("packed_attention", "flash", True)):
        small = _measure(backend, packed, args.seq, args)
        large = _measure(backend, packed, 2 * args.seq, args)
        result[f"{key}_peak_bytes_s{args.seq}"] = small
        result[f"{key}_peak_bytes_s{2 * args.seq}"] = large
        result[f"{key}_memory_growth_per_doubling"] = large / small
        print(f"{backend:8s} {'packed' if packed else 'causal'}: peak {small / 2**20:8.1f} MiB at "
              f"s={args.seq}, {large / 2**20:8.1f} MiB at s={2 * args.seq}, x{large / small:.2f}")
    result.update(hidden=args.hidden, heads=args.heads, query_groups=args.groups, batch=1,
                  dtype="fp32", reps=args.reps)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
