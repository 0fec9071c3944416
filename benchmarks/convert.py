"""Conversion benchmark: time and peak memory of hf-to-mcore and mcore-to-hf on Mixtral-8x7B-shaped
checkpoints with N layers, against a plain copy of the same files.

    .venv/bin/python benchmarks/convert.py --layers 2 4 --work /tmp/mlora-bench

For each N it writes (untimed, reused if present) a synthetic checkpoint with
tools/make_synthetic_mixtral.py, then measures:
  copy      copy every file of the HF folder (read, write, fsync per file, like the converters)
  to_mcore  `megatron-lora convert hf-to-mcore` in a child process
  to_hf     `megatron-lora convert mcore-to-hf` back to HF shards
Peak RSS is that of the whole child process tree: the kernel's high-water mark of the child
(wait4 ru_maxrss) and a 20 ms poll of the summed RSS of the child and its descendants, whichever
is larger. The baseline is the peak RSS of a child that only imports what the converters import.
Ends with one JSON line (keys below); per-N details are under "runs".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPORTS = ("import megatron_lora.cli, megatron_lora.cli.convert, "
           "megatron_lora.convert.hf_to_mcore, megatron_lora.convert.mcore_to_hf")


def measure(cmd) -> dict:
    """Run `cmd`; wall seconds and peak RSS (bytes) of its process tree."""
    import tempfile

    err = tempfile.TemporaryFile()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    peak, done = [0], threading.Event()

    def poll():
        try:
            root = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:
            return
        while not done.is_set():
            try:
                tree = [root] + root.children(recursive=True)
                peak[0] = max(peak[0], sum(p.memory_info().rss for p in tree))
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    _, status, usage = os.wait4(proc.pid, 0)  # reaps the child and returns its rusage
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    done.set()
    poller.join()
    if proc.returncode:
        err.seek(0)
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err.read().decode()[-3000:]}")
    return {"seconds": round(seconds, 2), "peak_rss_bytes": max(peak[0], usage.ru_maxrss * 1024)}


def run_child(argv) -> dict:
    return measure([sys.executable, "-m", "megatron_lora", *argv])


def plain_copy(src: str, dst: str) -> float:
    start = time.perf_counter()
    os.makedirs(dst)
    for name in sorted(os.listdir(src)):
        with open(os.path.join(src, name), "rb") as fi, open(os.path.join(dst, name), "wb") as fo:
            shutil.copyfileobj(fi, fo, 16 << 20)
            fo.flush()
            os.fsync(fo.fileno())
    return time.perf_counter() - start


def largest_tensor_bytes(hf_dir: str) -> int:
    """Size of the largest tensor of an HF checkpoint, from its safetensors headers."""
    from megatron_lora.convert.hf_files import HFCheckpoint, _nbytes

    return max(_nbytes(info) for info in HFCheckpoint(hf_dir).tensors.values())


def bench_layers(work: str, layers: int, keep: bool) -> dict:
    hf = os.path.join(work, f"hf-{layers}l")
    if not os.path.isdir(hf):
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_synthetic_mixtral.py"),
                        "--layers", str(layers), "--out", hf], check=True, cwd=ROOT)
    with open(os.path.join(hf, "model.safetensors.index.json")) as f:
        total = json.load(f)["metadata"]["total_size"]
    copy_dir, mcore, back = (os.path.join(work, f"{k}-{layers}l") for k in ("copy", "mcore", "back"))
    for d in (copy_dir, mcore, back):
        shutil.rmtree(d, ignore_errors=True)
    copy_s = plain_copy(hf, copy_dir)
    shutil.rmtree(copy_dir)
    to_mcore = run_child(["convert", "hf-to-mcore", "--hf-dir", hf, "--save", mcore, "--no-progress"])
    to_hf = run_child(["convert", "mcore-to-hf", "--load", mcore, "--save", back, "--no-progress"])
    if not keep:
        shutil.rmtree(mcore)
        shutil.rmtree(back)
    return {"layers": layers, "bytes": total, "largest_tensor_bytes": largest_tensor_bytes(hf),
            "copy_seconds": round(copy_s, 2),
            "to_mcore": to_mcore, "to_hf": to_hf}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--work", default="/tmp/mlora-bench", help="scratch folder (needs ~4x the "
                   "largest checkpoint of free disk)")
    p.add_argument("--keep", action="store_true", help="keep converted outputs")
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    baseline = measure([sys.executable, "-c", IMPORTS])["peak_rss_bytes"]
    runs = [bench_layers(args.work, n, args.keep) for n in sorted(args.layers)]
    largest_tensor = max(r["largest_tensor_bytes"] for r in runs)
    last = runs[-1]
    peak = max(max(r["to_mcore"]["peak_rss_bytes"], r["to_hf"]["peak_rss_bytes"]) for r in runs)

    def growth(direction):
        a, b = runs[0][direction]["peak_rss_bytes"], runs[-1][direction]["peak_rss_bytes"]
        return round((b - a) / a, 4)

    result = {
        "peak_rss_bytes": peak,
        "baseline_rss_bytes": baseline,
        "largest_tensor_bytes": largest_tensor,
        "rss_budget_bytes": 4 * largest_tensor + baseline,
        "convert_seconds": round(last["to_mcore"]["seconds"], 2),
        "mcore_to_hf_seconds": round(last["to_hf"]["seconds"], 2),
        "copy_seconds": last["copy_seconds"],
        "convert_over_copy": round(last["to_mcore"]["seconds"] / last["copy_seconds"], 3),
        "mcore_to_hf_over_copy": round(last["to_hf"]["seconds"] / last["copy_seconds"], 3),
        f"rss_growth_n{runs[0]['layers']}_to_n{last['layers']}": growth("to_mcore"),
        "rss_growth_mcore_to_hf": growth("to_hf"),
        "runs": runs,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
