"""Write a fine-grained FP8 copy of a Hugging Face safetensors folder, as DeepSeek-V3 is stored.

    python tools/make_fp8_example.py --hf tiny/hf --out tiny/hf-fp8 --block 128 128

Every 2-D `*.weight` but the embeddings and `lm_head` (norms are 1-D) becomes float8_e4m3fn with
a `*.weight_scale_inv` (fp32, one per block, the last block row / column holding what is left):
scale = max |w| of the block / 448 (1 where the block is zero), weight = fp8(w / scale). The
other tensors are kept as they are; config.json gets `quantization_config` {"quant_method":
"fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": BLOCK}; the shards
keep their names (the index gains the scales); the other files are copied. For trying and testing
FP8 reading on a small model (docs/conversion.md); the published FP8 checkpoints come quantised.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

FP8_MAX = 448.0  # largest float8_e4m3fn
INDEX = "model.safetensors.index.json"


def quantize(w, block):
    """w [M, N] -> (float8_e4m3fn [M, N], fp32 scale_inv [ceil(M / bm), ceil(N / bn)])."""
    import torch

    bm, bn = block
    m, n = w.shape
    w = w.to(torch.float32)
    gm, gn = -(-m // bm), -(-n // bn)
    padded = torch.zeros(gm * bm, gn * bn)
    padded[:m, :n] = w.abs()
    amax = padded.reshape(gm, bm, gn, bn).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantized_name(name: str, shape) -> bool:
    return len(shape) == 2 and name.endswith(".weight") and \
        "embed_tokens" not in name and not name.startswith("lm_head")


def make_fp8(hf: str, out: str, block) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    os.makedirs(out)
    shards = sorted(f for f in os.listdir(hf) if f.endswith(".safetensors"))
    weight_map = {}
    for shard in shards:
        tensors = {}
        with safe_open(os.path.join(hf, shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if quantized_name(name, t.shape):
                    tensors[name], tensors[name + "_scale_inv"] = quantize(t, block)
                else:
                    tensors[name] = t
        save_file(tensors, os.path.join(out, shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in tensors})
    for name in os.listdir(hf):
        src = os.path.join(hf, name)
        if name.endswith(".safetensors") or name in (INDEX, "config.json"):
            continue
        if not os.path.isfile(src):
            continue
        shutil.copyfile(src, os.path.join(out, name))
    if os.path.exists(os.path.join(hf, INDEX)):
        with open(os.path.join(out, INDEX), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf", required=True, help="the HF folder to quantise")
    p.add_argument("--out", required=True, help="the FP8 folder to write (must not exist)")
    p.add_argument("--block", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLS"))
    args = p.parse_args()
    make_fp8(args.hf, args.out, tuple(args.block))
    print(f"wrote {args.out} (FP8 blocks of {args.block[0]}x{args.block[1]})")


if __name__ == "__main__":
    main()
