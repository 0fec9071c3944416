"""Benchmark: `megatron-lora preprocess` throughput, and train's data start-up memory.

    .venv/bin/python benchmarks/data.py             # about 2 minutes on 2 CPU cores
    .venv/bin/python benchmarks/data.py --samples 20000 --startup-samples 10000 100000  # quicker

Preprocess: a JSONL file of --samples lines (text, prompt/response and messages in turn, 40-400
characters of words), tokenized with a byte-level BPE tokenizer of 8000 tokens trained here on
the same words (`tokenizers`, no download). `preprocess_tokens_per_s` = tokens written / wall time
of `megatron_lora.data.preprocess.preprocess` with --workers W (start-up and the final renames
included). The baseline is a plain single-process loop over the same file: read the lines, parse
them, and `Tokenizer.encode_batch` their texts 1000 lines at a time (no chat template, no loss
masks, nothing written; the Rust library may use several threads, as users run it).
`preprocess_ratio_vs_plain_encode` = preprocess tokens/s / baseline tokens/s (the issue's target
is >= 1.5 with 2 workers). The library's threads use every core, so W worker processes on a
machine of W cores cannot reach that; `preprocess_ratio_vs_single_thread_encode` compares with
the same loop run in a process limited to one tokenizer thread (RAYON_NUM_THREADS=1,
TOKENIZERS_PARALLELISM=false), as each preprocess worker is.

Start-up memory: for each of --startup-samples N, a prefix of N synthetic samples (8-120 tokens,
half of them with a loss-masked prompt) is written with megatron-core's builder, and a fresh
process does what one rank of `train --data-path PREFIX` does with its data (open, plan the
packing at --seq-length 512, build the first 8 batches of 8 sequences); its peak RSS is its
/proc VmHWM. `train_startup_rss_growth` = peak RSS at the largest N / at the smallest (target
<= 1.1 for 10^4 vs 10^6). Every rank of a run does the same, so a 4-rank node holds 4 times one
rank's figure (the memory maps are shared page cache). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

WORDS = ("the of and to in is was for on that with as by at from his an were are which this be "
         "or have had one not but all their they been has more other new some there time would "
         "mixture experts adapter rank alpha gradient tensor parallel sequence pipeline expert "
         "token router layer attention model data batch loss learning rate").split()


def _text(rng, lo=40, hi=400) -> str:
    n = rng.randint(lo, hi)
    out = []
    while sum(len(w) + 1 for w in out) < n:
        out.append(rng.choice(WORDS))
    return " ".join(out)


def make_jsonl(path: str, samples: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(samples):
            kind = i % 3
            if kind == 0:
                line = {"text": _text(rng)}
            elif kind == 1:
                line = {"prompt": _text(rng, 20, 200), "response": " " + _text(rng, 20, 200)}
            else:
                line = {"messages": [{"role": "user", "content": _text(rng, 20, 200)},
                                     {"role": "assistant", "content": _text(rng, 20, 200)}]}
            f.write(json.dumps(line) + "\n")


def make_tokenizer(folder: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rng = random.Random(1)
    tok.train_from_iterator([_text(rng) for _ in range(2000)], trainer)
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    return path


def plain_encode(path: str, tokenizer_path: str) -> tuple:
    """(tokens, seconds) of the baseline loop (module docstring)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    start, tokens, batch = time.perf_counter(), 0, []

    def flush():
        nonlocal tokens
        tokens += sum(len(e.ids) for e in tok.encode_batch(batch, add_special_tokens=False))
        batch.clear()

    with open(path, "rb") as f:
        for raw in f:
            record = json.loads(raw)
            if "text" in record:
                batch.append(record["text"])
            elif "prompt" in record:
                batch.append(record["prompt"] + record["response"])
            else:
                batch.append("".join(m["content"] for m in record["messages"]))
            if len(batch) >= 1000:
                flush()
    if batch:
        flush()
    return tokens, time.perf_counter() - start


def single_thread_encode(path: str, tokenizer_path: str) -> tuple:
    """plain_encode in a child process whose tokenizers library uses one thread."""
    code = (f"import sys; sys.path.insert(0, {os.path.join(REPO, 'benchmarks')!r}); import data; "
            f"print(*data.plain_encode({path!r}, {tokenizer_path!r}))")
    env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    return int(out[-2]), float(out[-1])


def make_prefix(prefix: str, samples: int, seed: int = 0) -> None:
    """A prefix of `samples` synthetic samples with loss masks, written with megatron's builder."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    tokens = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    targets = IndexedDatasetBuilder(prefix + "_targets.bin", dtype=np.uint8)
    lengths = rng.integers(8, 121, samples)
    for i, n in enumerate(lengths.tolist()):
        ids = rng.integers(0, 8000, n, dtype=np.uint16)
        mask = np.ones(n, dtype=np.uint8)
        if i % 2:
            mask[: n // 2] = 0
        tokens.add_document(ids, [n])
        targets.add_document(mask, [n])
    tokens.finalize(prefix + ".idx")
    targets.finalize(prefix + "_targets.idx")


_STARTUP = """
import sys
sys.path.insert(0, {repo!r})
from megatron_lora.data.sources import open_data
from megatron_lora.data.tokenizers import ByteTokenizer

tok = ByteTokenizer()
tok.vocab_size = 8000  # the prefix's ids go up to 8000; only pad_id is used to pack

data = open_data([{prefix!r}], tok, 512, seed=1)
for i in range(8):
    data.train.batch(i * 8, 8)
# VmHWM: this process's peak RSS (getrusage's ru_maxrss would include the parent's at the fork).
with open("/proc/self/status") as f:
    peak = int(f.read().split("VmHWM:")[1].split()[0]) * 1024
print(peak, len(data.train), data.samples)
"""


def startup_rss(prefix: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _STARTUP.format(repo=REPO, prefix=prefix)],
                          capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"))
    rss, rows, samples = proc.stdout.split()[-3:]
    return {"peak_rss_bytes": int(rss), "rows": int(rows), "samples": int(samples)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=60000, help="JSONL lines for preprocess")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--startup-samples", type=int, nargs="+", default=[10**4, 10**6])
    p.add_argument("--skip-startup", action="store_true")
    args = p.parse_args()

    from megatron_lora.data.preprocess import preprocess

    result = {"samples": args.samples, "workers": args.workers, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data.jsonl")
        make_jsonl(data, args.samples)
        tokenizer = make_tokenizer(tmp)
        plain_tokens, plain_s = plain_encode(data, tokenizer)
        single_tokens, single_s = single_thread_encode(data, tokenizer)
        start = time.perf_counter()
        stats = preprocess([data], tokenizer, os.path.join(tmp, "p"), workers=args.workers,
                           progress_interval=-1)
        seconds = time.perf_counter() - start
        result.update(
            input_bytes=os.path.getsize(data), preprocess_tokens=stats.tokens,
            preprocess_seconds=round(seconds, 3),
            preprocess_tokens_per_s=round(stats.tokens / seconds),
            plain_encode_tokens=plain_tokens, plain_encode_seconds=round(plain_s, 3),
            plain_encode_tokens_per_s=round(plain_tokens / plain_s),
            preprocess_ratio_vs_plain_encode=round((stats.tokens / seconds)
                                                   / (plain_tokens / plain_s), 3),
            single_thread_encode_seconds=round(single_s, 3),
            single_thread_encode_tokens_per_s=round(single_tokens / single_s),
            preprocess_ratio_vs_single_thread_encode=round((stats.tokens / seconds)
                                                           / (single_tokens / single_s), 3))
        if not args.skip_startup:
            startup = {}
            for n in args.startup_samples:
                prefix = os.path.join(tmp, f"s{n}")
                make_prefix(prefix, n)
                startup[str(n)] = startup_rss(prefix)
            result["startup"] = startup
            sizes = sorted(args.startup_samples)
            result["train_startup_rss_growth"] = round(
                startup[str(sizes[-1])]["peak_rss_bytes"]
                / startup[str(sizes[0])]["peak_rss_bytes"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
