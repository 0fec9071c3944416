"""Host reads, kernel-bearing ops and trainable tensors of a training step at several expert counts:
figures that do not depend on the machine.

    python benchmarks/host_reads.py                  # E = 8, 64, 128; 1 micro-batch a step
    python benchmarks/host_reads.py --experts 8 --micro-batches 1 4   # one E, 1 and 4

For each expert count E a tiny random Mixtral (transformers' from_config: h 64, 4 MoE layers,
top-2 of E experts) is trained 4 iterations at --log-interval 2 under testing/device_check.py
with --count-ops (testing/op_census.py): "frozen" experts (LoRA r=4 on attention only:
linear_qkv, linear_proj) and LoRA on attention and every expert's fc1/fc2, the experts as
megatron's SequentialMLP and as GroupedExperts, global batch 4 in one micro-batch per step
(--micro-batches 1 4: also in four). Per run:
    reads         host reads of device values (each a stream synchronisation on a GPU) in the
                  third step (between log lines, after the first step made Adam's state), split
                  into the package's (megatron_lora/) and megatron-core's; `log` the package's in
                  the second step, which ends at a log line. Reads made inside autograd's engine
                  (built-in ops' backward, gradient hooks) are not seen (testing/device_check.py).
    kernel ops    aten ops of the third step that launch work on the device (forward, backward,
                  optimizer step; views, allocations and host-only ops left out)
    trainable     trainable tensors in all, and inside each MoE layer (router, experts, adapters)
Then the issue's targets, each PASS or FAIL: host reads per LoRA step <= the frozen-expert step's
+ 2 per MoE layer (each E, micro-batch count and expert kind), the LoRA step's reads the same at
every E, and trainable tensors per MoE layer the same at every E. One JSON line with every figure,
the read sites and each step's most frequent ops.
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
LAYERS = 4
STEADY, LOG = 3, 2  # the steps read: between log lines after the first; one ending at a log line


def make_model(directory: str, experts: int) -> None:
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(
        vocab_size=320, hidden_size=64, intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False,
    )).save_pretrained(directory)
    with open(os.path.join(directory, "..", "data.jsonl"), "w") as f:
        for i in range(64):
            f.write(json.dumps({"text": f"sample {i}: " + "abcdefgh" * (1 + i % 5)}) + "\n")


def _train(mode: str, micro: int) -> list:
    targets, grouped = MODES[mode]
    return ["train", "--load-hf", "hf", "--data-path", "data.jsonl", "--tokenizer", "byte",
            "--seq-length", "32", "--micro-batch-size", str(micro), "--global-batch-size", "4",
            "--train-iters", "4", "--log-interval", "2", "--lr", "1e-3", "--lora-rank", "4",
            "--lora-target-modules", *targets,
            "--moe-grouped-gemm" if grouped else "--no-moe-grouped-gemm"]


def measure(experts: int, micro_batches=(1, 4)) -> list:
    """[{experts, mode, micro_batches, between_logs, at_log_line, kernel_ops, top_ops,
    trainable_tensors, trainable_per_moe_layer, sites_over_4_steps}] for E = experts."""
    with tempfile.TemporaryDirectory() as root:
        make_model(os.path.join(root, "hf"), experts)
        runs = [(mode, m) for mode in MODES for m in micro_batches]
        argv = [sys.executable, "-m", "megatron_lora.cli.device_check",
                os.path.join(root, "report.json"), "--count-ops", "--"]
        for k, (mode, m) in enumerate(runs):
            argv += (["--then"] if k else []) + _train(mode, 4 // m)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True,
                             timeout=1800)
        with open(os.path.join(root, "report.json")) as f:
            report = json.load(f)
        if report["errors"] or any(report["exit_codes"]):
            raise SystemExit(f"host_reads.py: the checked runs failed: {report['errors']}\n"
                             f"{out.stderr[-3000:]}")
    ops = {(o["command"], o["step"]): o for o in report["ops"]}
    trainable = {t["command"]: t for t in report["trainable"]}
    rows = []
    for k, (mode, m) in enumerate(runs):
        reads = [r for r in report["reads"] if r["command"] == k and not r["setup"]]
        first = min(r["step"] for r in reads)  # every step reads (megatron's grad norm)
        per_step = collections.defaultdict(collections.Counter)
        for r in reads:
            per_step[r["step"] - first + 1]["package" if "/megatron_lora/" in r["site"]
                                            else "megatron"] += 1
        sites = collections.Counter(
            r["site"].split("site-packages/")[-1].split("/megatron_lora/")[-1] for r in reads)
        rows.append({"experts": experts, "mode": mode, "micro_batches": m,
                     "between_logs": dict(per_step[STEADY]), "at_log_line": dict(per_step[LOG]),
                     "kernel_ops": ops[(k, STEADY)]["kernel_ops"],
                     "top_ops": ops[(k, STEADY)]["top"],
                     "trainable_tensors": trainable[k]["total"],
                     "trainable_per_moe_layer": trainable[k]["per_moe_layer"],
                     "sites_over_4_steps": dict(sites)})
    return rows


def _reads(row) -> int:
    return sum(row["between_logs"].values())


def targets(rows) -> list:
    """[(target, passed, detail)]: the issue's CPU targets over `rows` (module docstring)."""
    by = {(r["experts"], r["mode"], r["micro_batches"]): r for r in rows}
    out = []
    for grouped in ("", "_grouped"):
        kind = "GroupedExperts" if grouped else "SequentialMLP"
        lora = sorted((e, m) for e, mode, m in by if mode == "experts" + grouped)
        excess = {(e, m): _reads(by[e, "experts" + grouped, m])
                  - _reads(by[e, "attention" + grouped, m]) for e, m in lora}
        worst = max(excess.values())
        out.append((f"{kind}: host reads per LoRA step <= frozen experts' + 2 per MoE layer "
                    f"({2 * LAYERS})", worst <= 2 * LAYERS,
                    "excess " + ", ".join(f"E={e} x{m}: {x}" for (e, m), x in excess.items())))
        for m in sorted({m for _, m in lora}):
            seen = {e: _reads(by[e, "experts" + grouped, m]) for e, mm in lora if mm == m}
            out.append((f"{kind}, {m} micro-batch(es): host reads per LoRA step the same at "
                        f"every E", _same(seen.values()),
                        ", ".join(f"E={e}: {n}" for e, n in seen.items())))
        seen = {e: by[e, "experts" + grouped, m]["trainable_per_moe_layer"] for e, m in lora
                if m == lora[0][1]}
        out.append((f"{kind}: trainable tensors per MoE layer (LoRA) the same at every E",
                    _same(tuple(v) for v in seen.values()),
                    ", ".join(f"E={e}: {v[0] if len(set(v)) == 1 else v}"
                              for e, v in seen.items())))
    return out


def _same(values):
    """True when every value is the same, None (not checked) when there is only one."""
    values = list(values)
    return None if len(values) < 2 else len(set(values)) == 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, nargs="+", default=[8, 64, 128])
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1], choices=[1, 2, 4],
                   help="micro-batches per step of global batch 4 (default 1)")
    args = p.parse_args(argv)
    rows = [row for e in args.experts for row in measure(e, args.micro_batches)]
    print(f"{'E':>4} {'experts':14s} {'LoRA on':18s} {'micro':>5} | {'reads: package':>14} "
          f"{'megatron':>8} {'log':>4} | {'kernel ops':>10} | {'trainable':>9} "
          f"{'per MoE layer':>13}")
    for r in rows:
        a, b = r["between_logs"], r["at_log_line"]
        kind = "GroupedExperts" if r["mode"].endswith("_grouped") else "SequentialMLP"
        lora = "attention+experts" if r["mode"].startswith("experts") else "attention"
        per_layer = set(r["trainable_per_moe_layer"])
        print(f"{r['experts']:4d} {kind:14s} {lora:18s} {r['micro_batches']:5d} | "
              f"{a.get('package', 0):14d} {a.get('megatron', 0):8d} {b.get('package', 0):4d} | "
              f"{r['kernel_ops']:10d} | {r['trainable_tensors']:9d} "
              f"{str(per_layer.pop() if len(per_layer) == 1 else '?'):>13}")
    checked = targets(rows)
    for name, passed, detail in checked:
        verdict = {True: "PASS", False: "FAIL", None: "n/a (one E)"}[passed]
        print(f"{verdict}  {name}: {detail}")
    print(json.dumps({"rows": rows, "targets": [{"target": n, "passed": ok, "detail": d}
                                                for n, ok, d in checked]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
