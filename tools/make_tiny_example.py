"""Write a tiny random Hugging Face model of one family and a small learnable JSONL dataset,
locally.

    python tools/make_tiny_example.py --out DIR [--family mixtral]
writes DIR/hf (config.json + sharded safetensors, made by transformers' from_config, and a small
tokenizer: tokenizer.json + tokenizer_config.json with the family's chat-template format and
special tokens) and DIR/data.jsonl (short question/answer samples a LoRA can learn in a few dozen
steps). Families (FAMILIES): mixtral (the default; Mistral `[INST]`), qwen3_moe and qwen2_moe
(ChatML), olmoe (Tulu `<|user|>`), glm4_moe (`[gMASK]<sop><|user|>`), deepseek_v3 and deepseek_v2
(`<｜User｜>` / `<｜Assistant｜>`), gpt_oss (harmony `<|start|>user<|message|>`); each tiny model
has its family's features (shared experts, dense first layers, group routing, multi-latent
attention, attention sinks and sliding windows, biases). No downloads.
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


def make_model(directory: str, seed: int = 0, family: str = "mixtral") -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    if family == "mixtral":  # (the layout every page and test of the Mixtral path knows)
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**TINY)).float()
    else:
        config_class, config = FAMILIES[family]["config"]
        model = transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, config_class)(**config)).float()
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


COMMON = dict(vocab_size=TINY["vocab_size"], hidden_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.05, tie_word_embeddings=False)

# ChatML (Qwen): <|im_start|>role\ncontent<|im_end|>\n
CHATML = ("{%- for message in messages -%}"
          "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
          "{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
# Tulu (OLMoE-Instruct): <|user|>\ncontent\n<|assistant|>\ncontent<|endoftext|>
TULU = ("{%- for message in messages -%}"
        "{%- if message['role'] == 'assistant' -%}"
        "{{- '<|assistant|>\\n' + message['content'] + eos_token + '\\n' -}}"
        "{%- else -%}{{- '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' -}}"
        "{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}")
# GLM-4.5: [gMASK]<sop> once, then <|role|>\ncontent. (The published template ends an answer
# with the next role token, a stop token of its generation_config; here eos_token ends it, so
# that the trained span holds the stop.)
GLM = ("{{- '[gMASK]<sop>' -}}"
       "{%- for message in messages -%}"
       "{{- '<|' + message['role'] + '|>\\n' + message['content'] -}}"
       "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}{%- endif -%}"
       "{%- endfor -%}"
       "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}")
# DeepSeek-V3 / V2: BOS, the system text, then <｜User｜>... <｜Assistant｜>...<｜end▁of▁sentence｜>
DEEPSEEK = ("{{- bos_token -}}"
            "{%- for message in messages -%}"
            "{%- if message['role'] == 'system' -%}{{- message['content'] -}}"
            "{%- elif message['role'] == 'user' -%}"
            "{{- '<\uff5cUser\uff5c>' + message['content'] -}}"
            "{%- else -%}{{- '<\uff5cAssistant\uff5c>' + message['content'] + eos_token -}}"
            "{%- endif -%}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{- '<\uff5cAssistant\uff5c>' -}}{%- endif -%}")
# gpt-oss (harmony): <|start|>role<|message|>content<|end|>; answers on the final channel
HARMONY = ("{%- for message in messages -%}"
           "{%- if message['role'] == 'assistant' -%}"
           "{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] -}}"
           "{{- '<|return|>' -}}"
           "{%- else -%}"
           "{{- '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' -}}"
           "{%- endif -%}{%- endfor -%}"
           "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}")

_DEEPSEEK_V3 = dict(COMMON, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32,
                    n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
                    n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                    norm_topk_prob=True, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                    qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=0)
# family: its transformers config class and tiny config; its tokenizer's special tokens
# (bos, eos, others) and chat template.
FAMILIES = {
    "mixtral": dict(config=("MixtralConfig", TINY), bos="<s>", eos="</s>", extra=(),
                    template=CHAT_TEMPLATE),
    "qwen3_moe": dict(config=("Qwen3MoeConfig", dict(
        COMMON, intermediate_size=96, moe_intermediate_size=48, head_dim=16, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True)), bos=None, eos="<|im_end|>",
        extra=("<|endoftext|>", "<|im_start|>"), template=CHATML),
    "qwen2_moe": dict(config=("Qwen2MoeConfig", dict(
        COMMON, intermediate_size=96, moe_intermediate_size=48,
        shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2)),
        bos=None, eos="<|im_end|>", extra=("<|endoftext|>", "<|im_start|>"), template=CHATML),
    "olmoe": dict(config=("OlmoeConfig", dict(
        COMMON, intermediate_size=48, num_experts=4, num_experts_per_tok=2)),
        bos=None, eos="<|endoftext|>", extra=("<|user|>", "<|assistant|>", "<|system|>"),
        template=TULU),
    "glm4_moe": dict(config=("Glm4MoeConfig", dict(
        COMMON, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=4, n_group=1, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=True,
        attention_bias=True, partial_rotary_factor=0.5, num_nextn_predict_layers=0)),
        bos=None, eos="<|endoftext|>",
        extra=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"), template=GLM),
    "deepseek_v3": dict(config=("DeepseekV3Config", _DEEPSEEK_V3),
                        bos="<\uff5cbegin\u2581of\u2581sentence\uff5c>",
                        eos="<\uff5cend\u2581of\u2581sentence\uff5c>",
                        extra=("<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"), template=DEEPSEEK),
    "deepseek_v2": dict(config=("DeepseekV2Config", dict(
        _DEEPSEEK_V3, q_lora_rank=None, num_experts_per_tok=2, n_group=1, topk_group=1,
        topk_method="greedy", norm_topk_prob=False, n_shared_experts=2,
        routed_scaling_factor=1.0)),
        bos="<\uff5cbegin\u2581of\u2581sentence\uff5c>",
        eos="<\uff5cend\u2581of\u2581sentence\uff5c>",
        extra=("<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"), template=DEEPSEEK),
    "gpt_oss": dict(config=("GptOssConfig", dict(
        COMMON, intermediate_size=64, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
        # YaRN as published (factor 32 over 4096 positions), scaled to 256 positions
        rope_parameters=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32,
                             beta_fast=32.0, beta_slow=1.0, truncate=False,
                             rope_theta=150000.0))),
        bos=None, eos="<|return|>",
        extra=("<|start|>", "<|message|>", "<|end|>", "<|channel|>", "<|endoftext|>"),
        template=HARMONY),
}


def make_tokenizer(directory: str, texts, vocab_size: int, family: str = "mixtral") -> None:
    """A SentencePiece-style BPE ("\u2581" for spaces, <unk> id 0, then the family's special
    tokens), trained on `texts`, with at most `vocab_size` ids so every id has a row of the
    model's embedding; the family's chat template in tokenizer_config.json."""
    if family != "mixtral":
        return _make_family_tokenizer(directory, texts, vocab_size, FAMILIES[family])
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


def _make_family_tokenizer(directory: str, texts, vocab_size: int, spec: dict) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    special = [t for t in (spec["bos"], spec["eos"]) if t] + list(spec["extra"])
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    # the templates' newlines are characters of the alphabet, not <unk>
    tok.train_from_iterator(list(texts) + ["\n"], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", *special], show_progress=False))
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": spec["bos"],
                   "eos_token": spec["eos"], "unk_token": "<unk>", "pad_token": None,
                   "additional_special_tokens": list(spec["extra"]),
                   "chat_template": spec["template"]}, f, indent=1, ensure_ascii=False)


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
    p.add_argument("--family", choices=sorted(FAMILIES), default="mixtral",
                   help="the model family (its architecture, special tokens and chat template)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    make_model(os.path.join(args.out, "hf"), family=args.family)
    texts = make_data(os.path.join(args.out, "data.jsonl"), args.samples)
    make_tokenizer(os.path.join(args.out, "hf"), texts + [TOKENIZER_TEXT],
                   vocab_size=TINY["vocab_size"], family=args.family)
    print(f"tiny {args.family}: {os.path.join(args.out, 'hf')}; data: "
          f"{os.path.join(args.out, 'data.jsonl')}")


if __name__ == "__main__":
    main()
