"""Host reads of device values per training step (each a stream synchronisation on a GPU), by who
makes them, at several expert counts and micro-batch counts: figures that do not depend on the
machine.

    python benchmarks/host_reads.py                  # E = 8, 64, 128; 1 and 4 micro-batches
    python benchmarks/host_reads.py --experts 8      # one expert count

For each expert count E a tiny random Mixtral (transformers' from_config: h 64, 4 layers, top-2
of E experts) is trained 4 iterations at --log-interval 2 under testing/device_check.py, which
records every host read of a device value with its call site and step: with LoRA on attention
only (the experts frozen) and on attention and every expert's fc1/fc2, the experts as
megatron's SequentialMLP and as GroupedExperts, each with 1 and 4 micro-batches per step (global
batch 4). Reads made inside autograd's engine (built-in ops' backward, gradient hooks) are not
seen (testing/device_check.py). Prints, per run, the reads of a step between log lines
and of a step that ends at a log line, split into the package's (megatron_lora/) and
megatron-core's, then one JSON line with every figure and the sites.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTENTION = ["linear_qkv", "linear_proj"]
EXPERTS = ATTENTION + ["linear_fc1", "linear_fc2"]
# name -> (LoRA targets, grouped experts): the expert MLPs as megatron's SequentialMLP (a loop) or
# as GroupedExperts (the default on CUDA GPUs).
MODES = {"attention": (ATTENTION, False), "experts": (EXPERTS, False),
         "attention_grouped": (ATTENTION, True), "experts_grouped": (EXPERTS, True)}


def make_model(directory: str, experts: int) -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(
        vocab_size=320, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False,
    )).save_pretrained(directory)
    with open(os.path.join(directory, "..", "data.jsonl"), "w") as f:
        for i in range(64):
            f.write(json.dumps({"text": f"sample {i}: " + "abcdefgh" * (1 + i % 5)}) + "\n")


def _train(save: str, mode: str, micro: int) -> list:
    targets, grouped = MODES[mode]
    return ["train", "--load-hf", "hf", "--data-path", "data.jsonl", "--tokenizer", "byte",
            "--seq-length", "32", "--micro-batch-size", str(micro), "--global-batch-size", "4",
            "--train-iters", "4", "--log-interval", "2", "--lr", "1e-3", "--lora-rank", "4",
            "--lora-target-modules", *targets,
            "--moe-grouped-gemm" if grouped else "--no-moe-grouped-gemm", "--save", save]


def measure(experts: int) -> list:
    """[{experts, mode, micro_batches, between_logs, at_log_line, sites}] for E = experts."""
    with tempfile.TemporaryDirectory() as root:
        make_model(os.path.join(root, "hf"), experts)
        runs = [(mode, micro) for mode in MODES for micro in (1, 4)]
        argv = [sys.executable, "-m", "megatron_lora.cli.device_check",
                os.path.join(root, "report.json"), "--"]
        for k, (mode, micro) in enumerate(runs):
            argv += (["--then"] if k else []) + _train(f"runs/{mode}{micro}", mode, micro)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True,
                             timeout=900)
        with open(os.path.join(root, "report.json")) as f:
            report = json.load(f)
        if report["errors"] or any(report["exit_codes"]):
            raise SystemExit(f"host_reads.py: the checked runs failed: {report['errors']}\n"
                             f"{out.stderr[-3000:]}")
    rows = []
    for k, (mode, micro) in enumerate(runs):
        reads = [r for r in report["reads"] if r["command"] == k and not r["setup"]]
        first = min(r["step"] for r in reads)  # every step reads (megatron's grad norm)
        per_step = collections.defaultdict(collections.Counter)
        for r in reads:
            per_step[r["step"] - first + 1]["package" if "/megatron_lora/" in r["site"]
                                            else "megatron"] += 1
        sites = collections.Counter(
            r["site"].split("site-packages/")[-1].split("/megatron_lora/")[-1] for r in reads)
        rows.append({"experts": experts, "mode": mode, "micro_batches": 4 // micro,
                     "between_logs": dict(per_step[1]), "at_log_line": dict(per_step[2]),
                     "sites_over_4_steps": dict(sites)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, nargs="+", default=[8, 64, 128])
    args = p.parse_args(argv)
    rows = [row for e in args.experts for row in measure(e)]
    print(f"{'E':>4} {'LoRA on':17s} {'micro':>5} | {'step: package':>13} {'megatron':>8} | "
          f"{'log step: package':>17} {'megatron':>8}")
    for r in rows:
        a, b = r["between_logs"], r["at_log_line"]
        print(f"{r['experts']:4d} {r['mode']:17s} {r['micro_batches']:5d} | "
              f"{a.get('package', 0):13d} {a.get('megatron', 0):8d} | "
              f"{b.get('package', 0):17d} {b.get('megatron', 0):8d}")
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
