"""Tiny HF tokenizer folders for the chat-template tests, built locally (no downloads).

- `mistral_folder`: a SentencePiece-style BPE (Metaspace "\u2581", <unk>/<s>/</s>),
  tokenizer_class LlamaTokenizer as Mixtral's folder has, and a Mistral `[INST]` template given
  as tokenizer_config.json's list of named templates.
- `chatml_folder`: a byte-level BPE with <|im_start|>/<|im_end|>/<|endoftext|>, a ChatML template
  (a default system message, `add_generation_prompt`), as a string in tokenizer_config.json, or
  with `{% generation %}` blocks around the assistant text (generation=True).
"""

from __future__ import annotations

import functools
import json
import os
import string

CORPUS = [
    "Hello there, how are you today?", "I am fine, thank you. What colour is the sky?",
    "The sky is blue. Cafe au lait, naive resume: caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fc\u00f1\u00ee",
    "Reverse the word lamp: pmal. Reverse the word star: rats.", "system user assistant",
    "You are a helpful assistant. Answer briefly.", string.printable,
] * 3

MISTRAL_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}\n"
    "{{- bos_token -}}\n"
    "{%- for message in messages -%}\n"
    "  {%- if message['role'] == 'system' -%}\n"
    "    {%- set ns.system = message['content'] + '\\n\\n' -%}\n"
    "  {%- elif message['role'] == 'user' -%}\n"
    "    {%- if loop.index0 > 1 and messages[loop.index0 - 1]['role'] == 'user' -%}\n"
    "      {{- raise_exception('user and assistant turns must alternate') -}}\n"
    "    {%- endif -%}\n"
    "    {{- '[INST] ' + ns.system + message['content'] + ' [/INST]' -}}\n"
    "    {%- set ns.system = '' -%}\n"
    "  {%- else -%}\n"
    "    {{- ' ' + message['content'] + eos_token -}}\n"
    "  {%- endif -%}\n"
    "{%- endfor -%}\n"
)

CHATML_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}\n"
    "{% for message in messages %}\n"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' }}"
    "{% if not loop.last or message['role'] != 'assistant' %}{{ '\\n' }}{% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}\n"
)

CHATML_GENERATION_TEMPLATE = (
    "{% for message in messages %}\n"
    "{% if message['role'] == 'assistant' %}\n"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\\n' }}{% if false %}{% endif %}\n"
    "{% else %}\n"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% if false %}{% endif %}\n"
    "{% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}\n"
)


def _write(folder, tokenizer_json: str, config):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(tokenizer_json)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return str(folder)


@functools.lru_cache(maxsize=None)
def _sentencepiece_style(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok.to_str()


@functools.lru_cache(maxsize=None)
def _byte_level(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok.to_str()


def mistral_folder(folder, legacy: bool = False, vocab_size: int = 420):
    return _write(folder, _sentencepiece_style(vocab_size), {
        "tokenizer_class": "LlamaTokenizer", "legacy": legacy, "add_bos_token": True,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
        "chat_template": [{"name": "default", "template": MISTRAL_TEMPLATE},
                          {"name": "tool_use", "template": "{{ raise_exception('no tools') }}"}],
    })


def chatml_folder(folder, generation: bool = False, vocab_size: int = 360):
    return _write(folder, _byte_level(vocab_size), {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHATML_GENERATION_TEMPLATE if generation else CHATML_TEMPLATE,
    })


def template_folder(folder, template):
    """The ChatML folder's tokenizer with `template` as tokenizer_config.json's chat_template
    (any JSON value: a string, a list of named templates, or something malformed)."""
    folder = chatml_folder(folder)
    path = os.path.join(folder, "tokenizer_config.json")
    with open(path) as f:
        config = json.load(f)
    config["chat_template"] = template
    with open(path, "w") as f:
        json.dump(config, f)
    return folder
