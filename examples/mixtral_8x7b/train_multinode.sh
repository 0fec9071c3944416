#!/usr/bin/env bash
# LoRA fine-tuning of Mixtral 8x7B on NNODES nodes of 8 GPUs with torchrun's rendezvous:
# TP2 x EP8 with sequence parallelism (16 GPUs), data parallel across the rest.
# Run the same command on every node:
#   NNODES=2 MASTER=node0.example:29500 HF=... DATA=... SAVE=... bash train_multinode.sh
set -euo pipefail
: "${NNODES:?}" "${MASTER:?host:port of the rendezvous}" "${HF:?}" "${DATA:?}" "${SAVE:?}"
# `--load DIR` among the arguments replaces --load-hf (the two exclude each other).
BASE=(--load-hf "$HF")
for arg in "$@"; do case "$arg" in --load | --load=*) BASE=() ;; esac; done
torchrun --nnodes "$NNODES" --nproc-per-node 8 \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER" --rdzv-id "${RDZV_ID:-mixtral-lora}" \
  -m megatron_lora train \
  "${BASE[@]}" --tokenizer "$HF" --data-path "$DATA" \
  --tensor-model-parallel-size 2 --expert-model-parallel-size 8 --sequence-parallel \
  --moe-token-dispatcher-type alltoall \
  --seq-length 4096 --attention-backend flash --micro-batch-size 1 --global-batch-size 128 \
  --train-iters 1000 --lr 2e-4 --min-lr 2e-5 --lr-warmup-iters 50 --bf16 \
  --lora-rank 16 --lora-alpha 32 \
  --lora-target-modules linear_qkv linear_proj linear_fc1 linear_fc2 \
  --save "$SAVE" --save-interval 100 --log-interval 10 --tensorboard-dir "$SAVE/tensorboard" "$@"
