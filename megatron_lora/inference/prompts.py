"""Prompts for `generate`: a JSONL file, one object per line, and their token ids.

    {"prompt": "text"}                                  tokenized as transformers' tokenizer(text)
    {"messages": [{"role": "user", "content": "..."}]}  the tokenizer's chat template with the
                                                        generation prompt, tokenized as
                                                        apply_chat_template(..., tokenize=True,
                                                        add_generation_prompt=True)

Other keys are kept and written back with the result. Errors name the file and line.
"""

from __future__ import annotations

from typing import List

from megatron_lora.data import jsonl
from megatron_lora.data.tokenizers import ByteTokenizer
from megatron_lora.jsonfile import decode_utf8, loads, os_reason, short


class PromptError(ValueError):
    """A prompts file that cannot be used; the message names the file and line."""


def read_prompts(path: str) -> List[dict]:
    """The records of a prompts JSONL file (blank lines skipped), each checked for its form and
    for its size (data/jsonl.py MAX_LINE_BYTES, as training lines)."""
    from megatron_lora.data.files import regular_file_problem

    problem = regular_file_problem(path)  # a FIFO or device would block or never end
    if problem is not None:
        raise PromptError(f"{path}: cannot read the prompts file ({problem})")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise PromptError(f"{path}: cannot read the prompts file ({os_reason(exc)})") from None
    text = decode_utf8(raw, path, PromptError)
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        # bounded before the Rust tokenizer sees it: it aborts the process on a huge prompt
        if len(line) * 4 > jsonl.MAX_LINE_BYTES and len(line.encode()) > jsonl.MAX_LINE_BYTES:
            raise PromptError(jsonl.too_long(where, jsonl.MAX_LINE_BYTES))
        record = loads(line, where, PromptError)
        if not isinstance(record, dict):
            raise PromptError(f"{where}: expected a JSON object, got {short(record)}")
        if "prompt" in record:
            if not isinstance(record["prompt"], str) or not record["prompt"]:
                raise PromptError(f"{where}: 'prompt' must be a non-empty string")
        elif "messages" in record:
            messages = record["messages"]
            if (not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in messages)):
                raise PromptError(f"{where}: 'messages' must be a non-empty list of "
                                  f"{{\"role\": str, \"content\": str}} objects")
        else:
            raise PromptError(f"{where}: expected a 'prompt' (text) or 'messages' (chat) field, "
                              f"got keys {sorted(record)}")
        records.append(record)
    if not records:
        raise PromptError(f"{path}: no prompts (expected one JSON object per line)")
    return records


def prompt_ids(tokenizer, record: dict, where: str) -> List[int]:
    """The token ids transformers would feed `generate` for this record (module docstring)."""
    if "prompt" in record:
        return encode_prompt(tokenizer, record["prompt"])
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise PromptError(f"{where}: 'messages' need a tokenizer with a chat template "
                          f"(tokenizer_config.json 'chat_template' or chat_template.jinja); "
                          f"{tokenizer.name} has none: give a 'prompt' instead")
    from megatron_lora.data.chat import ChatTemplateError

    try:
        text = template.render(record["messages"], add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise PromptError(f"{where}: {exc}") from None
    return tokenizer.encode(text)  # as apply_chat_template: the template wrote the specials


def encode_prompt(tokenizer, text: str) -> List[int]:
    """transformers' tokenizer(text).input_ids: tokenizer.json's post-processor places the
    special tokens (Mixtral's puts <s> first; transformers 5 ignores tokenizer_config.json's
    add_bos_token/add_eos_token when there is a tokenizer.json, and so does this). The byte
    tokenizer: <s> first, as in training samples."""
    if isinstance(tokenizer, ByteTokenizer):
        return [tokenizer.bos_id, *tokenizer.encode(text)]
    return tokenizer.encode_with_special_tokens(text)
