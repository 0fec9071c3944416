"""`megatron-lora data-preview`: the first samples of a JSONL file as `train` will train on them.

    megatron-lora data-preview --data-path train.jsonl --tokenizer Mixtral-8x7B-v0.1 \\
        --seq-length 4096 --samples 3

Reads the data exactly as `train` does (megatron_lora.data: the tokenizer's chat template for
`messages`, truncation to --seq-length+1 tokens) and prints, per sample, its runs of tokens: one
line per run, `+` for trained tokens (loss on them) and `.` for loss-masked ones (context only),
with the run's token count and its text JSON-quoted (special tokens written out). The first token
of a sample is never trained (nothing precedes it within its packed sample). Then the counts:
tokens, trained tokens, truncated. One process, no torch.distributed.
"""

from __future__ import annotations

import json
import sys
from typing import Iterator, List, Tuple

LEGEND = ("legend: each line is one run of tokens: '+' trained (loss on these tokens), "
          "'.' loss-masked (context, not trained); then the run's token count and its text as a "
          "JSON string (special tokens written out)")


def register(sub) -> None:
    p = sub.add_parser(
        "data-preview", help="print the first samples as train will see them, loss-masked "
        "tokens marked",
        description="Print the first --samples samples of --data-path as `train` tokenizes, "
        "masks and truncates them, with the loss-masked tokens marked, and their token counts.")
    p.add_argument("--data-path", required=True, help="JSONL training data (text, "
                   "prompt/response or messages lines)")
    p.add_argument("--tokenizer", required=True, help="'byte', a tokenizer.json, or an HF "
                   "tokenizer folder (its chat template renders 'messages')")
    p.add_argument("--seq-length", type=int, required=True, help="as given to train: samples "
                   "longer than seq-length+1 tokens are truncated")
    p.add_argument("--samples", type=int, default=5, help="how many samples to print "
                   "(default: %(default)s)")
    p.add_argument("--count-all", action="store_true", help="also read the whole file and print "
                   "the counts train would report (samples, truncated, skipped)")
    p.set_defaults(func=_run)


def runs(trained: List[int]) -> Iterator[Tuple[int, int, int]]:
    """(start, end, trained) for each maximal run of equal flags."""
    start = 0
    for i in range(1, len(trained) + 1):
        if i == len(trained) or trained[i] != trained[start]:
            yield start, i, trained[start]
            start = i


def run_texts(tokenizer, ids: List[int], spans) -> List[str]:
    """The text of each (start, end) run of `ids`: the growth of the decoded prefix, so a run
    keeps the leading space a decoder drops at the start of a text (the run decoded alone where
    the prefix does not grow as a prefix, e.g. inside a split UTF-8 character)."""
    out, prefix = [], {0: ""}  # decoded ids[:i] by i

    def upto(i):
        if i not in prefix:
            prefix[i] = tokenizer.decode(ids[:i], skip_special_tokens=False)
        return prefix[i]

    for start, end in spans:
        before, through = upto(start), upto(end)
        out.append(through[len(before):] if through.startswith(before) else
                   tokenizer.decode(ids[start:end], skip_special_tokens=False))
    return out


def trained_flags(loss_mask: List[int]) -> List[int]:
    """What training learns: loss_mask, except the first token (never a prediction target)."""
    return [0] + [int(bool(m)) for m in loss_mask[1:]] if loss_mask else []


def format_sample(tokenizer, where: str, sample, kept) -> List[str]:
    """The lines printed for one sample: a header with the counts, then one line per run."""
    flags = trained_flags(kept.loss_mask)
    n, n_trained = len(kept.tokens), sum(flags)
    cut = len(sample.tokens) - n
    header = (f"{where}: {n} tokens, {n_trained} trained, "
              + (f"truncated (cut {cut} of {len(sample.tokens)})" if cut else "not truncated"))
    if n_trained == 0:
        header += "; skipped by train (nothing to train on)"
    spans = list(runs(flags))
    texts = run_texts(tokenizer, kept.tokens, [(a, b) for a, b, _ in spans])
    lines = [header]
    for (a, b, trained), text in zip(spans, texts):
        lines.append(f"  {'+' if trained else '.'} {b - a:>5} {json.dumps(text, ensure_ascii=False)}")
    return lines


def _run(args) -> int:
    from megatron_lora.data.chat import ChatTemplateError
    from megatron_lora.data.jsonl import DataError, iter_samples, truncate, usable
    from megatron_lora.data.tokenizers import TokenizerError, load_tokenizer

    def fail(message: str) -> int:
        print(f"megatron-lora data-preview: error: {message}", file=sys.stderr)
        return 2

    if args.seq_length < 1:
        return fail(f"--seq-length must be at least 1, got {args.seq_length}")
    if args.samples < 0:
        return fail(f"--samples must be 0 or more, got {args.samples}")
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except (TokenizerError, ChatTemplateError, FileNotFoundError) as exc:
        return fail(str(exc))
    template = getattr(tokenizer, "chat_template", None)
    print(f"tokenizer: {getattr(tokenizer, 'name', args.tokenizer)} ({tokenizer.vocab_size} "
          f"tokens); messages: "
          + (f"chat template of {template.origin}" if template is not None
             else "Mistral [INST] format (the tokenizer has no chat template)"))
    print(LEGEND)
    max_tokens = args.seq_length + 1
    shown = tokens = trained = truncated = 0
    counts = dict(samples=0, truncated=0, skipped=0)
    try:
        for where, sample in iter_samples(args.data_path, tokenizer):
            kept = truncate(sample, max_tokens)
            counts["samples"] += 1
            counts["truncated"] += kept is not sample
            counts["skipped"] += not usable(kept)
            if shown < args.samples:
                print()
                print("\n".join(format_sample(tokenizer, where, sample, kept)))
                shown += 1
                tokens += len(kept.tokens)
                trained += sum(trained_flags(kept.loss_mask))
                truncated += kept is not sample
            elif not args.count_all:
                break
    except (DataError, ChatTemplateError) as exc:  # a template's limit: ChatTemplateError
        return fail(str(exc))
    print()
    print(f"shown: {shown} samples, {tokens} tokens, {trained} trained, {truncated} truncated "
          f"(to --seq-length+1 = {max_tokens} tokens)")
    if args.count_all:
        print(f"file: {counts['samples']} samples, {counts['truncated']} truncated, "
              f"{counts['skipped']} skipped (nothing to train on after truncation)")
    return 0
