#!/usr/bin/env bash
# LoRA fine-tuning of gpt-oss-120b on one node of 8 GPUs (80 GB or more): attention TP2 with
# sequence parallelism, the 128 experts over EP8 at expert-TP 1 (GPT-OSS's experts have biases).
#   HF=/data/gpt-oss-120b DATA=/data/train.jsonl SAVE=/ckpt/gpt-oss-120b-lora bash train_120b_1node.sh
# The base is read straight from the HF folder (each rank reads its own slices; the MXFP4 experts
# are dequantised to bf16 on load); convert it once with `megatron-lora convert hf-to-mcore` and
# add `--load MCORE_DIR` to this script's arguments to start faster.
set -euo pipefail
: "${HF:?set HF to the Hugging Face gpt-oss-120b folder}"
: "${DATA:?set DATA to a JSONL file}"
: "${SAVE:?set SAVE to the adapter checkpoint folder}"
# `--load DIR` among the arguments replaces --load-hf (the two exclude each other).
BASE=(--load-hf "$HF")
for arg in "$@"; do case "$arg" in --load | --load=*) BASE=() ;; esac; done
torchrun --nproc-per-node 8 -m megatron_lora train \
  "${BASE[@]}" --tokenizer "$HF" --data-path "$DATA" \
  --tensor-model-parallel-size 2 --expert-model-parallel-size 8 \
  --expert-tensor-parallel-size 1 --sequence-parallel \
  --moe-token-dispatcher-type alltoall \
  --seq-length 4096 --attention-backend flash --micro-batch-size 1 --global-batch-size 64 \
  --train-iters 1000 --lr 2e-4 --min-lr 2e-5 --lr-warmup-iters 50 --lr-decay-style cosine \
  --clip-grad 1.0 --weight-decay 0.0 --bf16 --seed 1234 \
  --lora-rank 16 --lora-alpha 32 --lora-dropout 0.05 \
  --lora-target-modules linear_qkv linear_proj linear_fc1 linear_fc2 \
  --save "$SAVE" --save-interval 100 --log-interval 10 \
  --tensorboard-dir "$SAVE/tensorboard" "$@"
