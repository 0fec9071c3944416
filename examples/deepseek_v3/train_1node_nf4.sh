#!/usr/bin/env bash
# QLoRA fine-tuning of DeepSeek-V3 (671B) on one node of 8 H200: the frozen decoder linears
# (multi-latent attention, dense MLPs, every routed and shared expert) held in NF4, TP8 x EP8 with
# expert-TP 1 and sequence parallelism (about 72 GiB per GPU; 52 GiB with
# --recompute-granularity full: README.md).
#   HF=/data/DeepSeek-V3 DATA=/data/train.jsonl SAVE=/ckpt/deepseek-v3-qlora bash train_1node_nf4.sh
# The base is read straight from the HF folder: its FP8 weights are dequantised as they are read,
# then quantised to NF4 linear by linear (each rank its own shards, streamed: docs/qlora.md). The
# multi-token-prediction layer is not built.
set -euo pipefail
: "${HF:?set HF to the Hugging Face DeepSeek-V3 folder}"
: "${DATA:?set DATA to a JSONL file}"
: "${SAVE:?set SAVE to the adapter checkpoint folder}"
# `--load DIR` among the arguments replaces --load-hf (the two exclude each other).
BASE=(--load-hf "$HF")
for arg in "$@"; do case "$arg" in --load | --load=*) BASE=() ;; esac; done
torchrun --nproc-per-node 8 -m megatron_lora train \
  "${BASE[@]}" --tokenizer "$HF" --data-path "$DATA" --base-quantization nf4 \
  --tensor-model-parallel-size 8 --expert-model-parallel-size 8 \
  --expert-tensor-parallel-size 1 --sequence-parallel --moe-token-dispatcher-type alltoall \
  --seq-length 4096 --attention-backend flash --micro-batch-size 1 --global-batch-size 64 \
  --train-iters 1000 --lr 2e-4 --min-lr 2e-5 --lr-warmup-iters 50 --lr-decay-style cosine \
  --clip-grad 1.0 --weight-decay 0.0 --bf16 --seed 1234 \
  --lora-rank 16 --lora-alpha 32 --lora-dropout 0.05 \
  --lora-target-modules linear_qkv linear_proj linear_fc1 linear_fc2 \
  --save "$SAVE" --save-interval 100 --log-interval 10 \
  --tensorboard-dir "$SAVE/tensorboard" "$@"
