#!/usr/bin/env bash
# A tiny Mixtral-shaped megatron-core GPT model (RMSNorm, SwiGLU, RoPE, GQA, 4 experts, top-2)
# run at world size 1 and then on 4 CPU ranks at several parallel layouts; prints whether every
# layout reproduces the single-rank loss. Needs no GPU and no downloads.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-$(mktemp -d)}
export PYTHONWARNINGS=ignore
"$PY" -m megatron_lora parity reference --dir "$OUT"
"$PY" -m torch.distributed.run --nproc-per-node 4 --master-port 29533 \
  -m megatron_lora parity check --dir "$OUT" --layouts TP2+SP EP2 PP2 PP2xEP2 TP2xEP2+SP
"$PY" -m torch.distributed.run --nproc-per-node 4 --master-port 29534 \
  -m megatron_lora parity check --dir "$OUT" --layouts EP2 TP2xEP2+SP --dispatcher alltoall
