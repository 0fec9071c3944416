"""Write a Mixtral-8x7B-shaped Hugging Face checkpoint with N of its 32 layers and random weights.

    python tools/make_synthetic_mixtral.py --layers 2 --out /tmp/mixtral-2l [--shard-size 2GB]

Real 8x7B shapes (hidden 4096, ffn 14336, 8 experts, top-2, 32 heads, 8 KV heads, vocab 32000,
untied), bf16, HF tensor names, several `model-0000i-of-0000N.safetensors` shards plus
`model.safetensors.index.json` and `config.json`. Tensors are generated and written one at a
time, so memory stays at about one tensor whatever N is. Output appears atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lora.cli.convert import parse_size  # noqa: E402
from megatron_lora.convert.atomic import atomic_directory  # noqa: E402
from megatron_lora.convert.mapping import hf_shapes  # noqa: E402
from megatron_lora.convert.safetensors_write import StreamingSafetensorsWriter, nbytes  # noqa: E402
from megatron_lora.families import model_info  # noqa: E402

MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rope_theta": 1e6,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
    "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16",
    "router_aux_loss_coef": 0.02, "initializer_range": 0.02,
}


def _hf_order(name: str):
    parts = name.split(".")
    if parts[1] == "layers":
        return (1, int(parts[2]), name)
    return (0 if "embed_tokens" in name else 2, 0, name)


def make(out: str, layers: int, shard_bytes: int, seed: int = 0, overwrite: bool = False,
         **config) -> dict:
    """config: config.json fields to change (other shapes than 8x7B's, for benchmarks)."""
    cfg = dict(MIXTRAL_8X7B, num_hidden_layers=layers, **config)
    info = model_info(cfg)
    dtype = torch.bfloat16
    shapes = sorted(hf_shapes(info).items(), key=lambda kv: _hf_order(kv[0]))
    shards, size = [[]], 0
    for name, shape in shapes:
        b = nbytes(shape, dtype)
        if shards[-1] and size + b > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += b
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    with atomic_directory(out, overwrite) as tmp:
        for i, members in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            entries = [(n, s, dtype) for n, s in members]
            with StreamingSafetensorsWriter(os.path.join(tmp, file), entries) as w:
                for name, shape in members:
                    if name.endswith("norm.weight"):
                        t = torch.ones(shape, dtype=dtype)
                    else:
                        t = torch.empty(shape, dtype=dtype).uniform_(-0.02, 0.02, generator=gen)
                    w.write(name, t)
                    weight_map[name] = file
                    total += t.nbytes
                    del t
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    largest = max(nbytes(s, dtype) for _, s in shapes)
    return {"layers": layers, "shards": len(shards), "total_bytes": total,
            "largest_tensor_bytes": largest}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, required=True, help="number of layers (1..32)")
    p.add_argument("--out", required=True, help="output folder (must not exist)")
    p.add_argument("--shard-size", type=parse_size, default="2GB")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args()
    if not 1 <= args.layers <= 32:
        p.error("--layers must be in 1..32")
    print(json.dumps(make(args.out, args.layers, args.shard_size, args.seed, args.overwrite)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
