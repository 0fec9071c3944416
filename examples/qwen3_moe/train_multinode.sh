#!/usr/bin/env bash
# LoRA fine-tuning of Qwen3-235B-A22B on 2 nodes of 8 GPUs (torchrun's c10d rendezvous):
# TP2 x PP2 x EP4 with sequence parallelism and full recomputation. Run on every node:
#   NNODES=2 MASTER=node0:29500 HF=/data/Qwen3-235B-A22B DATA=/data/train.jsonl \
#     SAVE=/ckpt/qwen3-235b-lora bash train_multinode.sh
set -euo pipefail
: "${HF:?set HF to the Hugging Face Qwen3-235B-A22B folder}"
: "${DATA:?set DATA to a JSONL file}"
: "${SAVE:?set SAVE to the adapter checkpoint folder}"
: "${MASTER:?set MASTER to host:port of the first node}"
# `--load DIR` among the arguments replaces --load-hf (the two exclude each other).
BASE=(--load-hf "$HF")
for arg in "$@"; do case "$arg" in --load | --load=*) BASE=() ;; esac; done
torchrun --nnodes "${NNODES:-2}" --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint "$MASTER" \
  -m megatron_lora train \
  "${BASE[@]}" --tokenizer "$HF" --data-path "$DATA" \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
  --expert-model-parallel-size 4 --sequence-parallel --moe-token-dispatcher-type alltoall \
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
  --seq-length 4096 --attention-backend flash --micro-batch-size 1 --global-batch-size 64 \
  --train-iters 1000 --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 50 --lr-decay-style cosine \
  --clip-grad 1.0 --weight-decay 0.0 --bf16 --seed 1234 \
  --lora-rank 16 --lora-alpha 32 --lora-dropout 0.05 \
  --lora-target-modules linear_qkv linear_proj linear_fc1 linear_fc2 \
  --save "$SAVE" --save-interval 100 --log-interval 10 \
  --tensorboard-dir "$SAVE/tensorboard" "$@"
