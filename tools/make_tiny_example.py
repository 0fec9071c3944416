"""Write a tiny random Hugging Face Mixtral and a small learnable JSONL dataset, locally.

    python tools/make_tiny_example.py --out DIR
writes DIR/hf (config.json + sharded safetensors, made by transformers) and DIR/data.jsonl
(short question/answer samples a LoRA can learn in a few dozen steps). No downloads.
"""

from __future__ import annotations

import argparse
import json
import os
import random

TINY = dict(
    vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    max_position_embeddings=256, rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False,
    initializer_range=0.05,
)


def make_model(directory: str, seed: int = 0) -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**TINY)).float()
    model.save_pretrained(directory, max_shard_size="300KB")


def make_data(path: str, n: int = 256, seed: int = 0) -> None:
    """Prompt/response pairs with a fixed rule: the answer repeats the colour and reverses the
    word, so the loss on responses can fall well below the untrained model's."""
    rng = random.Random(seed)
    colours = ["red", "blue", "green", "gold", "pink", "gray"]
    words = ["lamp", "tree", "fish", "book", "door", "star", "cake", "ship"]
    with open(path, "w") as f:
        for _ in range(n):
            c, w = rng.choice(colours), rng.choice(words)
            f.write(json.dumps({"prompt": f"{c} {w}?", "response": f" {c} {w[::-1]}."}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=256)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    make_model(os.path.join(args.out, "hf"))
    make_data(os.path.join(args.out, "data.jsonl"), args.samples)
    print(f"tiny Mixtral: {os.path.join(args.out, 'hf')}; data: "
          f"{os.path.join(args.out, 'data.jsonl')}")


if __name__ == "__main__":
    main()
