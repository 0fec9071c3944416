"""JSONL training data -> megatron-core indexed datasets (`megatron-lora preprocess`).

Output at `--output-prefix P` (the files Megatron-LM's `preprocess_data.py` writes, read by
`megatron.core.datasets.indexed_dataset.IndexedDataset`):

| file | contents |
|---|---|
| `P.bin`, `P.idx` | token ids: one sequence and one document per sample, dtype uint16 for a vocabulary under 65500 tokens, else int32 (megatron's `DType.optimal_dtype`) |
| `P_targets.bin`, `P_targets.idx` | the samples' loss masks, uint8 0/1, one sequence per sample of the same length as its tokens |
| `P.json` | what wrote them: format, tokenizer name and special ids, counts |

A sample is what `train` makes of one JSONL line (`data/jsonl.py`'s `parse_record`: bos, text,
eos, loss masks, chat templates), untruncated; `train` truncates to --seq-length+1 and drops
samples left without a target when it reads the prefix, as it does for JSONL. Megatron-LM tools
read `P.bin`/`P.idx` as an ordinary dataset of one-sequence documents.

Writing is streaming: lines are read and tokenized in chunks of `chunk_lines`, at most
`2 * workers` chunks in flight, so memory does not grow with the input (the writer,
data/indexed_writer.py, keeps only the per-sample lengths, 4 bytes a sample; it writes
megatron-core's format without importing megatron-core). `workers > 1` tokenizes in a process
pool of single-threaded workers; chunks are written in input order, so the files are
byte-identical for any number of workers.

Outputs are atomic: everything is written under temporary names (`P.bin.partial-PID`, ...) and
renamed at the end, `P_targets.idx` and then `P.idx` last, after an existing `P.idx` has been
removed (with overwrite). `train` accepts a prefix only when `P.idx` exists, so a run killed at any
point leaves no prefix it accepts; an exception removes the temporary files, and the next run at
the same prefix removes those a killed run left (`remove_stale_partials`).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from megatron_lora.data import jsonl
from megatron_lora.data.jsonl import DataError, bounded_lines, parse_record, too_long
from megatron_lora.jsonfile import decode_utf8, loads

FORMAT = "megatron-lora indexed samples"
FORMAT_VERSION = 1
TARGETS_SUFFIX = "_targets"
# Every file of a prefix, in the order they are renamed into place (P.idx last: it makes the prefix).
SUFFIXES = (".bin", TARGETS_SUFFIX + ".bin", ".json", TARGETS_SUFFIX + ".idx", ".idx")

Chunk = List[Tuple[str, bytes]]  # ("file:line", raw line bytes, or a LongLine message)


class PreprocessError(ValueError):
    """Bad preprocess input or output; the message names the file (and line) or the flag."""


@dataclass
class PreprocessStats:
    samples: int = 0
    tokens: int = 0
    trained_tokens: int = 0
    lines: int = 0
    skipped: List[str] = field(default_factory=list)  # messages of the bad lines skipped
    bytes_read: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {"samples": self.samples, "tokens": self.tokens,
                "trained_tokens": self.trained_tokens, "lines": self.lines,
                "skipped_lines": len(self.skipped)}


def prefix_files(prefix: str) -> List[str]:
    """The paths of every file a prefix has, in rename order."""
    return [prefix + s for s in SUFFIXES]


class LongLine(str):
    """In a chunk instead of a line's bytes: the message of a line longer than MAX_LINE_BYTES
    (data/jsonl.py), which is never read whole nor tokenised."""


def _chunks(paths: Sequence[str], chunk_lines: int, stats: PreprocessStats) -> Iterator[Chunk]:
    """Non-blank lines of `paths`, in order, `chunk_lines` at a time (bytes counted as read)."""
    from megatron_lora.data.files import open_regular

    chunk: Chunk = []
    for path in paths:
        with open_regular(path, PreprocessError, f"--input {path}") as f:
            start = f.tell()
            for lineno, raw in bounded_lines(f):
                stats.bytes_read += f.tell() - start
                start = f.tell()
                if raw is None:  # refused before any tokenizer sees it: a bad line
                    chunk.append((f"{path}:{lineno}", LongLine(too_long(f"{path}:{lineno}",
                                                                        jsonl.MAX_LINE_BYTES))))
                elif not raw.strip():
                    continue
                else:
                    chunk.append((f"{path}:{lineno}", raw))
                if len(chunk) >= chunk_lines:
                    yield chunk
                    chunk = []
    if chunk:
        yield chunk


# (tokens int64 [T], loss masks uint8 [T], lengths int32 [n], bad-line messages)
Encoded = Tuple[np.ndarray, np.ndarray, np.ndarray, List[str]]


def encode_chunk(tokenizer, chunk: Chunk) -> Encoded:
    """The samples of the good lines of `chunk`, in order, as flat arrays (T tokens of n
    samples: their token ids, loss masks and lengths; one array each to pass between
    processes), and the DataError message ("file:line: ...") of each bad line."""
    tokens: List[int] = []
    masks: List[int] = []
    lengths: List[int] = []
    bad: List[str] = []
    for where, raw in chunk:
        if isinstance(raw, LongLine):
            bad.append(str(raw))
            continue
        try:
            sample = parse_record(tokenizer, loads(decode_utf8(raw, where, DataError), where,
                                                   DataError), where)
        except DataError as exc:
            bad.append(str(exc))
            continue
        tokens += sample.tokens
        masks += sample.loss_mask
        lengths.append(len(sample.tokens))
    return (np.asarray(tokens, dtype=np.int64), np.asarray(masks, dtype=np.uint8),
            np.asarray(lengths, dtype=np.int32), bad)


_WORKER_TOKENIZER = None


def _worker_init(tokenizer_spec: str) -> None:
    """One worker process, one thread: `--workers` processes use `--workers` cores (the
    tokenizers library's thread pool would otherwise start a thread per core in each)."""
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    from megatron_lora.data.tokenizers import load_tokenizer

    _WORKER_TOKENIZER = load_tokenizer(tokenizer_spec)


def _worker_encode(chunk: Chunk) -> Encoded:
    return encode_chunk(_WORKER_TOKENIZER, chunk)


def _encoded(chunks: Iterator[Chunk], tokenizer, tokenizer_spec: str,
             workers: int) -> Iterator[Encoded]:
    """encode_chunk of each chunk, in input order; with workers > 1 in a process pool with at
    most 2 * workers chunks in flight (Pool.imap would read the whole input ahead)."""
    if workers <= 1:
        for chunk in chunks:
            yield encode_chunk(tokenizer, chunk)
        return
    import multiprocessing

    # fork: the workers start at once; the parent never tokenizes, so the tokenizers library's
    # threads are not in use when it forks.
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(workers, initializer=_worker_init, initargs=(tokenizer_spec,)) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_worker_encode, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _Progress:
    """One line on stderr every `interval` seconds: samples, samples/s, bytes read of total."""

    def __init__(self, total_bytes: int, interval: float, stream=None):
        self.total, self.interval = total_bytes, interval
        self.stream = stream if stream is not None else sys.stderr
        self.start = self.last = time.monotonic()

    def line(self, stats: PreprocessStats) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        pct = 100.0 * stats.bytes_read / self.total if self.total else 100.0
        return (f"preprocess: {stats.samples} samples, {stats.tokens} tokens, "
                f"{stats.samples / elapsed:.0f} samples/s, {stats.bytes_read / 2**20:.1f} of "
                f"{self.total / 2**20:.1f} MiB read ({pct:.0f}%), {elapsed:.1f} s")

    def maybe(self, stats: PreprocessStats) -> None:
        now = time.monotonic()
        if self.interval >= 0 and now - self.last >= self.interval:
            self.last = now
            print(self.line(stats), file=self.stream, flush=True)


def check_prefix_free(prefix: str, overwrite: bool) -> None:
    """Refuse an output prefix that has files already (unless overwrite) or whose folder is
    missing."""
    folder = os.path.dirname(os.path.abspath(prefix))
    if not os.path.isdir(folder):
        raise PreprocessError(f"--output-prefix {prefix}: the folder {folder} does not exist")
    existing = [p for p in prefix_files(prefix) if os.path.lexists(p)]
    if existing and not overwrite:
        raise PreprocessError(f"--output-prefix {prefix}: {', '.join(existing)} already "
                              f"exist(s); pass --overwrite to replace them")


def remove_stale_partials(prefix: str) -> List[str]:
    """Delete the temporary files (`P.bin.partial-PID`, ...) that a killed run at this prefix
    left, those whose writer PID no longer runs; returns their paths."""
    import glob

    removed = []
    for suffix in SUFFIXES:
        for path in glob.glob(glob.escape(f"{prefix}{suffix}.partial-") + "*"):
            pid = path.rsplit("-", 1)[1]
            if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
                os.unlink(path)
                removed.append(path)
    return removed


def preprocess(inputs: Sequence[str], tokenizer_spec: str, prefix: str, workers: int = 1,
               skip_bad_lines: bool = False, overwrite: bool = False, chunk_lines: int = 256,
               progress_interval: float = 5.0, progress_stream=None,
               _before_rename: Optional[Callable[[], None]] = None) -> PreprocessStats:
    """Write the samples of the JSONL files `inputs` (in order) at `prefix` (module docstring).

    Raises PreprocessError: a bad line ("file:line: reason") unless skip_bad_lines, an input
    that is not a regular file, an existing prefix without overwrite, a chat template that does
    not compile or reaches a rendering limit (data/chat_limits.py: every line would meet it, so
    it is not skipped), no samples at all, or samples without a token to train on. `_before_rename` (tests) runs after the data is
    written and before anything is renamed into place.
    """
    from megatron_lora.data.indexed_writer import IndexedWriter, token_dtype
    from megatron_lora.data.tokenizers import load_tokenizer

    if workers < 1:
        raise PreprocessError(f"--workers must be at least 1, got {workers}")
    if chunk_lines < 1:
        raise PreprocessError(f"--chunk-lines must be at least 1, got {chunk_lines}")
    check_prefix_free(prefix, overwrite)
    from megatron_lora.data.chat import ChatTemplateError
    from megatron_lora.data.files import regular_file_problem

    outputs = {os.path.realpath(p) for p in prefix_files(prefix)}
    for path in inputs:
        if not os.path.exists(path):
            raise PreprocessError(f"--input {path}: no such file")
        problem = regular_file_problem(path)  # a FIFO or device would block or never end
        if problem is not None:
            raise PreprocessError(f"--input {path}: cannot read: {problem}")
        if os.path.realpath(path) in outputs:  # even with --overwrite: an input is never replaced
            raise PreprocessError(f"--input {path} is one of the files of --output-prefix "
                                  f"{prefix}; choose another prefix")
    try:
        tokenizer = load_tokenizer(tokenizer_spec)
    except ChatTemplateError as exc:
        raise PreprocessError(f"--tokenizer {tokenizer_spec}: {exc}") from None
    remove_stale_partials(prefix)
    stats = PreprocessStats()
    progress = _Progress(sum(os.path.getsize(p) for p in inputs), progress_interval,
                         progress_stream)
    temp = {suffix: f"{prefix}{suffix}.partial-{os.getpid()}" for suffix in SUFFIXES}
    tokens_out = targets_out = None
    try:
        tokens_out = IndexedWriter(temp[".bin"], token_dtype(tokenizer.vocab_size))
        targets_out = IndexedWriter(temp[TARGETS_SUFFIX + ".bin"], np.uint8)
        for ids, masks, lengths, bad in _encoded(_chunks(inputs, chunk_lines, stats), tokenizer,
                                                 tokenizer_spec, workers):
            if bad and not skip_bad_lines:
                raise PreprocessError(f"{bad[0]} (pass --skip-bad-lines to skip bad lines)")
            stats.skipped += bad
            stats.lines += len(lengths) + len(bad)
            tokens_out.add(ids, lengths)
            targets_out.add(masks, lengths)
            stats.samples += len(lengths)
            stats.tokens += int(ids.size)
            stats.trained_tokens += int(np.count_nonzero(masks))
            progress.maybe(stats)
        if stats.samples == 0:
            raise PreprocessError(f"--input {' '.join(inputs)}: no samples"
                                  + (f" ({len(stats.skipped)} bad lines skipped, the first: "
                                     f"{stats.skipped[0]})" if stats.skipped else ""))
        if stats.trained_tokens == 0:
            raise PreprocessError(_nothing_to_train(inputs, tokenizer, stats))
        tokens_out.finalize(temp[".idx"])
        targets_out.finalize(temp[TARGETS_SUFFIX + ".idx"])
        stats.seconds = time.monotonic() - progress.start
        meta = {"format": FORMAT, "version": FORMAT_VERSION, "tokenizer": tokenizer_spec,
                "vocab_size": tokenizer.vocab_size, "bos_id": tokenizer.bos_id,
                "eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id,
                "targets": os.path.basename(prefix) + TARGETS_SUFFIX, **stats.to_dict()}
        with open(temp[".json"], "w") as f:
            json.dump(meta, f, indent=1)
        if _before_rename is not None:
            _before_rename()
        if os.path.lexists(prefix + ".idx"):  # overwrite: the old prefix stops being one first
            os.unlink(prefix + ".idx")
        for suffix in SUFFIXES:
            os.replace(temp[suffix], prefix + suffix)
    except BaseException as exc:
        for writer in (tokens_out, targets_out):
            if writer is not None:
                writer.close()
        for path in temp.values():
            if os.path.lexists(path):
                os.unlink(path)
        if isinstance(exc, ChatTemplateError):  # a limit reached (data/chat_limits.py)
            raise PreprocessError(str(exc)) from None
        raise
    return stats


def _nothing_to_train(inputs: Sequence[str], tokenizer, stats: PreprocessStats) -> str:
    """Why a run whose samples have no token to train on is refused (train would find no
    usable sample in the prefix)."""
    template = getattr(tokenizer, "chat_template", None)
    why = (f"; the chat template of {template.origin} marks no assistant text in any of them"
           if template is not None else "")
    return (f"--input {' '.join(inputs)}: no sample produced a token to train on "
            f"({stats.samples} samples, {stats.tokens} tokens){why}")


__all__ = ["FORMAT", "PreprocessError", "PreprocessStats", "TARGETS_SUFFIX", "check_prefix_free",
           "encode_chunk", "prefix_files", "preprocess"]
