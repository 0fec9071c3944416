"""The fast path on CPU, all ratios in one run: grouped experts, attention memory, training
throughput against transformers + PEFT with LoRA on every expert, activation recomputation.

    .venv/bin/python benchmarks/fast_path.py          # about 10-15 minutes on 2 CPU cores

Runs each benchmark in its own process, one after the other (run it alone: the machine is
noisy), and prints a table of the targets, then one JSON line with at least
    grouped_over_sequential_e8, _e64, _e128                   benchmarks/grouped_experts.py
    attention_memory_growth_per_doubling,
    unfused_attention_memory_growth_per_doubling              benchmarks/attention.py
    train_ratio_vs_peft_with_experts                          benchmarks/train.py (all targets)
    recompute_activation_ratio                                benchmarks/recompute.py
Each part's own docstring says what it measures and how.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# (JSON key in the part's last line, our key, target, "<=" or ">=")
TARGETS = [
    ("grouped_over_sequential_e8", "grouped_over_sequential_e8", 1.10, "<="),
    ("grouped_over_sequential_e64", "grouped_over_sequential_e64", 1.0, "<="),
    ("grouped_over_sequential_e128", "grouped_over_sequential_e128", 1.0, "<="),
    ("attention_memory_growth_per_doubling", "attention_memory_growth_per_doubling", 2.3, "<="),
    ("unfused_attention_memory_growth_per_doubling",
     "unfused_attention_memory_growth_per_doubling", None, None),
    ("ratio_vs_peft", "train_ratio_vs_peft_with_experts", 1.5, ">="),
    ("recompute_activation_ratio", "recompute_activation_ratio", 0.4, "<="),
]
PARTS = [
    ("grouped_experts.py", []),
    ("attention.py", []),
    ("train.py", ["--targets", "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]),
    ("recompute.py", []),
]


def run_part(script: str, args) -> dict:
    """The last JSON line of `benchmarks/<script>` run in a fresh process."""
    cmd = [sys.executable, os.path.join(HERE, script), *args]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    sys.stdout.write(out.stdout)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"{' '.join(cmd)} printed no JSON line")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=None, metavar="SCRIPT",
                        help="run only these parts (e.g. grouped_experts.py)")
    args = parser.parse_args(argv)
    started = time.time()
    found = {}
    for script, extra in PARTS:
        if args.only and script not in args.only:
            continue
        print(f"== benchmarks/{script} {' '.join(extra)}", flush=True)
        found.update(run_part(script, extra))
    summary = {}
    print(f"\n{'metric':46s} {'value':>8s} {'target':>9s}  met")
    for source, key, target, sense in TARGETS:
        if source not in found:
            continue
        value = float(found[source])
        summary[key] = round(value, 4)
        if target is None:
            print(f"{key:46s} {value:8.3f} {'-':>9s}")
            continue
        met = value <= target if sense == "<=" else value >= target
        print(f"{key:46s} {value:8.3f} {sense + ' ' + str(target):>9s}  {'yes' if met else 'NO'}")
    summary["seconds"] = round(time.time() - started, 1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
