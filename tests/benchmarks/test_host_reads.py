"""benchmarks/host_reads.py: its run at two small expert counts reports well-formed, consistent
figures (not the targets: those wait for the stacked expert adapters), and its pass/fail logic on
hand-made rows."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_host_reads_benchmark_output_is_well_formed():
    from benchmarks.host_reads import LAYERS, MODES

    out = subprocess.run([sys.executable, "benchmarks/host_reads.py", "--experts", "2", "4"],
                         cwd=REPO, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    rows = result["rows"]
    assert sorted((r["experts"], r["mode"]) for r in rows) == sorted(
        (e, m) for e in (2, 4) for m in MODES)
    table = [line for line in lines if line.split()[:1] in (["2"], ["4"])]
    assert len(table) == len(rows)  # one table row per run
    by = {(r["experts"], r["mode"]): r for r in rows}
    for (e, mode), r in by.items():
        assert r["micro_batches"] == 1
        # megatron's token dispatcher copies its counts to the host once per MoE layer
        assert r["between_logs"].get("megatron", 0) >= LAYERS, r
        # the package: the gradient norm's one read a step, and at a log line the losses since
        # the last one
        assert r["between_logs"].get("package") == 1, r
        assert r["at_log_line"].get("package") == 2, r
        assert r["trainable_per_moe_layer"] and len(r["trainable_per_moe_layer"]) == LAYERS
        assert sum(r["top_ops"].values()) <= r["kernel_ops"]
        if mode.startswith("attention"):  # linear_qkv, linear_proj: A and B each, per layer
            assert r["trainable_tensors"] == 4 * LAYERS, r
            assert r["trainable_per_moe_layer"] == [0] * LAYERS, r
        else:
            frozen = by[e, mode.replace("experts", "attention")]
            assert min(r["trainable_per_moe_layer"]) > 0, r
            assert r["trainable_tensors"] == 4 * LAYERS + sum(r["trainable_per_moe_layer"])
            assert r["kernel_ops"] > frozen["kernel_ops"] > 0
    targets = result["targets"]
    assert len(targets) == 2 * 3 and all(t["passed"] in (True, False) for t in targets)
    for t in targets:  # the table's verdict lines
        assert any(line.startswith(("PASS", "FAIL")) and t["target"] in line for line in lines)


def _row(e, mode, reads, per_layer):
    return {"experts": e, "mode": mode, "micro_batches": 1, "between_logs": {"megatron": reads},
            "trainable_per_moe_layer": [per_layer] * 4}


def test_targets_pass_and_fail_as_stated():
    """Reads: LoRA <= frozen experts' + 2 per MoE layer (4 layers: + 8), the same at every E;
    trainable tensors per MoE layer the same at every E; one E: not checked."""
    from benchmarks.host_reads import targets

    def verdicts(rows):
        return [passed for _, passed, _ in targets(rows)]

    stacked = [_row(e, m + g, r, t) for e in (8, 64) for g in ("", "_grouped")
               for m, r, t in (("attention", 5, 0), ("experts", 13, 4))]
    assert verdicts(stacked) == [True] * 6
    per_expert = [_row(e, m + g, r, t) for e in (8, 64) for g in ("", "_grouped")
                  for m, r, t in (("attention", 5, 0), ("experts", 14 + e, 4 * e))]
    assert verdicts(per_expert) == [False, False, False] * 2
    one_e = [r for r in stacked if r["experts"] == 8]
    assert verdicts(one_e) == [True, None, None] * 2
