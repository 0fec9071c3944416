"""JSONL training samples, one JSON object per line, in one of three forms:

    {"text": "..."}                                   causal LM: loss on every token
    {"prompt": "...", "response": "..."}              SFT: loss on the response only
    {"messages": [{"role": "user"|"assistant"|"system", "content": "..."}, ...]}
                                                      SFT: loss on assistant turns only

Chat turns are rendered with the tokenizer's own chat template when it has one
(`megatron_lora.data.chat`: tokens exactly as transformers' `apply_chat_template(messages,
tokenize=True)` gives them, loss on the assistant spans the template writes). Without a template
(and always for the byte tokenizer) they use the Mistral/Mixtral instruction format:
`<s>[INST] user [/INST] answer</s>` (a system message is prepended to the first user turn).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, List, Tuple

from megatron_lora.jsonfile import decode_utf8, loads, short


class DataError(ValueError):
    """Bad training data; the message names the file and line."""


# The longest line (one sample) read, in bytes. Tokenising a line takes ~15 bytes of memory per
# byte inside the Rust tokenizer, which aborts the process (exit 134, no Python error) when an
# allocation fails: a 200 MB line asked for 3 GiB. 16 MiB is millions of tokens, far beyond any
# sequence a sample is truncated to.
MAX_LINE_BYTES = 16 * 2**20


def too_long(where: str, limit: int) -> str:
    """The message for a line longer than `limit` bytes."""
    return (f"{where}: the line is longer than {limit} bytes (MAX_LINE_BYTES, one sample); "
            f"split or shorten it")


def bounded_lines(f, limit: int = None):
    """(line number, raw bytes or None) of each line of the binary file `f`: None for a line
    longer than `limit` bytes (default MAX_LINE_BYTES, newline excluded), whose rest is skipped
    in pieces of `limit` bytes, never held whole."""
    limit = MAX_LINE_BYTES if limit is None else limit
    lineno = 0
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) <= limit or raw.endswith(b"\n"):
            yield lineno, raw
            continue
        while raw and not raw.endswith(b"\n"):  # the rest of the long line
            raw = f.readline(limit + 1)
        yield lineno, None


@dataclass
class Sample:
    tokens: List[int]
    loss_mask: List[int]  # 1 where the token is a prediction target (its label position)


def _text(tok, text: str) -> Sample:
    ids = [tok.bos_id, *tok.encode(text), tok.eos_id] if tok.bos_id is not None else [*tok.encode(text), tok.eos_id]
    return Sample(ids, [1] * len(ids))


def _pieces(tok, pieces: List[Tuple[str, bool]]) -> Sample:
    """Concatenate (text, trained) pieces; bos first, eos after each trained piece."""
    tokens, mask = [], []
    if tok.bos_id is not None:
        tokens.append(tok.bos_id)
        mask.append(0)
    for text, trained in pieces:
        ids = tok.encode(text) + ([tok.eos_id] if trained else [])
        tokens += ids
        mask += [int(trained)] * len(ids)
    return Sample(tokens, mask)


def _templated(tok, messages, where: str) -> Sample:
    """`messages` through the tokenizer's chat template: loss on the assistant spans. A refusal
    is a DataError (a bad line); a limit reached (ChatTemplateLimitError, data/chat_limits.py)
    stays one, naming the line too: the template is at fault, not the line."""
    from megatron_lora.data.chat import ChatTemplateError, ChatTemplateLimitError, trained_mask

    template = tok.chat_template
    try:
        text, spans = template.assistant_spans(messages)
    except ChatTemplateLimitError as exc:
        raise ChatTemplateLimitError(f"{where}: {exc}") from None
    except ChatTemplateError as exc:
        raise DataError(f"{where}: {exc}") from None
    if not text.strip():
        raise DataError(f"{where}: the chat template of {template.origin} rendered only "
                        f"whitespace for this conversation, no tokens to train on")
    ids, offsets = tok.encode_with_offsets(text)
    return Sample(ids, trained_mask(offsets, spans))


def _messages(tok, messages, where: str) -> Sample:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise DataError(
                f"{where}: messages[{i}] must be {{'role': 'system'|'user'|'assistant', "
                f"'content': str}}, got {short(m)}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: 'messages' has no assistant turn to train on")
    if getattr(tok, "chat_template", None) is not None:
        return _templated(tok, messages, where)
    pieces, system = [], ""
    for m in messages:
        if m["role"] == "system":
            system = m["content"] + "\n\n"
        elif m["role"] == "user":
            pieces.append((f"[INST] {system}{m['content']} [/INST]", False))
            system = ""
        else:
            pieces.append((" " + m["content"], True))
    return _pieces(tok, pieces)


def parse_record(tok, record, where: str) -> Sample:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "text" in record:
        if not isinstance(record["text"], str):
            raise DataError(f"{where}: 'text' must be a string")
        return _text(tok, record["text"])
    if "prompt" in record or "response" in record:
        if not (isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str)):
            raise DataError(f"{where}: 'prompt' and 'response' must both be strings")
        return _pieces(tok, [(record["prompt"], False), (record["response"], True)])
    if "messages" in record:
        return _messages(tok, record["messages"], where)
    raise DataError(f"{where}: expected a 'text', 'prompt'/'response' or 'messages' field, "
                    f"got keys {sorted(record)}")


def iter_samples(path: str, tokenizer) -> Iterator[Tuple[str, Sample]]:
    """("file:line", sample) for each non-blank line of `path`, untruncated, in order.

    Raises DataError naming file:line for a malformed line or one longer than MAX_LINE_BYTES,
    or the file when it is not a regular file (a FIFO or device would block or read forever:
    data/files.py).
    """
    from megatron_lora.data.files import open_regular

    with open_regular(path, DataError) as f:
        for lineno, raw in bounded_lines(f):
            where = f"{path}:{lineno}"
            if raw is None:  # before the tokenizer sees it (module MAX_LINE_BYTES)
                raise DataError(too_long(where, MAX_LINE_BYTES))
            line = decode_utf8(raw, where, DataError)
            if not line.strip():
                continue
            yield where, parse_record(tokenizer, loads(line, where, DataError), where)


def truncate(sample: Sample, max_tokens: int) -> Sample:
    """The first `max_tokens` tokens of `sample` (itself when it fits)."""
    if len(sample.tokens) <= max_tokens:
        return sample
    return Sample(sample.tokens[:max_tokens], sample.loss_mask[:max_tokens])


def usable(sample: Sample) -> bool:
    """Whether a sample has a target after its first token (otherwise it teaches nothing)."""
    return sum(sample.loss_mask[1:]) > 0


def read_jsonl(path: str, tokenizer, max_tokens: int) -> Tuple[List[Sample], int]:
    """All samples of `path`; samples longer than `max_tokens` are truncated.

    Returns (samples, number truncated). Raises DataError naming file:line for a malformed line;
    blank lines are skipped, and so are samples left without a target after truncation.
    """
    samples, truncated = [], 0
    for _, sample in iter_samples(path, tokenizer):
        if len(sample.tokens) > max_tokens:
            sample = truncate(sample, max_tokens)
            truncated += 1
        if usable(sample):
            samples.append(sample)
    if not samples:
        raise DataError(f"{path}: no usable samples")
    return samples, truncated
