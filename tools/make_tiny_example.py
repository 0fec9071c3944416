"""Write a tiny random Hugging Face Mixtral and a small learnable JSONL dataset, locally.

    python tools/make_tiny_example.py --out DIR
writes DIR/hf (config.json + sharded safetensors, made by transformers, and a small tokenizer laid
out as Mixtral's: tokenizer.json + tokenizer_config.json with a Mistral `[INST]` chat template)
and DIR/data.jsonl (short question/answer samples a LoRA can learn in a few dozen steps).
No downloads.
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


# Beside the samples, so that prompts written in docs tokenize into words, not <unk>s.
TOKENIZER_TEXT = ("The capital of France is Paris. Hello, how are you? What colour is the sky? "
                  "[INST] [/INST] abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0123456789 .,:;!?'-()/")


def make_model(directory: str, seed: int = 0) -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    model = MixtralForCausalLM(MixtralConfig(**TINY)).float()
    model.save_pretrained(directory, max_shard_size="300KB")


# Mistral's [INST] format: a system message goes before the first user turn.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] + '\\n\\n' -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '[INST] ' + ns.system + message['content'] + ' [/INST]' -}}{%- set ns.system = '' -%}"
    "{%- else -%}{{- ' ' + message['content'] + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)


def make_tokenizer(directory: str, texts, vocab_size: int) -> None:
    """A SentencePiece-style BPE ("\u2581" for spaces, <unk>/<s>/</s> as ids 0/1/2), trained on
    `texts`, with at most `vocab_size` ids so every id has a row of the model's embedding."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    # BOS in front, from tokenizer.json's post-processor, as Mixtral's own tokenizer.json does it
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "legacy": False, "add_bos_token": True,
                   "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "pad_token": None, "chat_template": CHAT_TEMPLATE},
                  f, indent=1)


def make_data(path: str, n: int = 256, seed: int = 0) -> None:
    """Prompt/response pairs with a fixed rule: the answer repeats the colour and reverses the
    word, so the loss on responses can fall well below the untrained model's."""
    rng = random.Random(seed)
    colours = ["red", "blue", "green", "gold", "pink", "gray"]
    words = ["lamp", "tree", "fish", "book", "door", "star", "cake", "ship"]
    texts = []
    with open(path, "w") as f:
        for _ in range(n):
            c, w = rng.choice(colours), rng.choice(words)
            sample = {"prompt": f"{c} {w}?", "response": f" {c} {w[::-1]}."}
            f.write(json.dumps(sample) + "\n")
            texts.append(sample["prompt"] + sample["response"])
    return texts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--samples", type=int, default=256)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    make_model(os.path.join(args.out, "hf"))
    texts = make_data(os.path.join(args.out, "data.jsonl"), args.samples)
    make_tokenizer(os.path.join(args.out, "hf"), texts + [TOKENIZER_TEXT],
                   vocab_size=TINY["vocab_size"])
    print(f"tiny Mixtral: {os.path.join(args.out, 'hf')}; data: "
          f"{os.path.join(args.out, 'data.jsonl')}")


if __name__ == "__main__":
    main()
