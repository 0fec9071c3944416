#!/usr/bin/env bash
# LoRA fine-tuning of DeepSeek-V3 (671B) in bf16 on 2 nodes of 8 H200 (16 GPUs): TP8 x EP16 with
# expert-TP 1, sequence parallelism and full recomputation (about 86 GiB per GPU: README.md).
# Convert the published checkpoint once: `convert hf-to-mcore` reads its FP8 weights
# (`quantization_config` fp8, 128x128 block scales) and dequantises them to bf16 (about 1.3 TB
# written); the multi-token-prediction layer is carried along unchanged, not built:
#   megatron-lora convert hf-to-mcore --hf-dir /data/DeepSeek-V3 --save /ckpt/deepseek-v3-mcore
# (`--load-hf "$HF"` instead of `--load` reads and dequantises the FP8 folder at every start.)
# Then on every node, NODE_RANK 0 on the node MASTER_ADDR names, 1 on the other:
#   MASTER_ADDR=node0 NODE_RANK=0 HF=/data/DeepSeek-V3 MCORE=/ckpt/deepseek-v3-mcore \
#     DATA=/data/train.jsonl SAVE=/ckpt/deepseek-v3-lora bash train_nodes.sh
# More nodes (NNODES=4, ...) add data parallelism at the same per-GPU memory.
set -euo pipefail
: "${HF:?set HF to the Hugging Face DeepSeek-V3 folder (its tokenizer)}"
: "${MCORE:?set MCORE to the checkpoint convert hf-to-mcore wrote}"
: "${DATA:?set DATA to a JSONL file}"
: "${SAVE:?set SAVE to the adapter checkpoint folder}"
: "${MASTER_ADDR:?set MASTER_ADDR to the first node's address}"
: "${NODE_RANK:?set NODE_RANK to this node's index (0 .. NNODES-1)}"
torchrun --nnodes "${NNODES:-2}" --node-rank "$NODE_RANK" --nproc-per-node 8 \
  --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-29500}" \
  -m megatron_lora train \
  --load "$MCORE" --tokenizer "$HF" --data-path "$DATA" \
  --tensor-model-parallel-size 8 --expert-model-parallel-size 16 \
  --expert-tensor-parallel-size 1 --sequence-parallel --moe-token-dispatcher-type alltoall \
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
  --seq-length 4096 --attention-backend flash --micro-batch-size 1 --global-batch-size 64 \
  --train-iters 1000 --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 50 --lr-decay-style cosine \
  --clip-grad 1.0 --weight-decay 0.0 --bf16 --seed 1234 \
  --lora-rank 16 --lora-alpha 32 --lora-dropout 0.05 \
  --lora-target-modules linear_qkv linear_proj linear_fc1 linear_fc2 \
  --save "$SAVE" --save-interval 100 --log-interval 10 \
  --tensorboard-dir "$SAVE/tensorboard" "$@"
