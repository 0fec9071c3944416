#!/usr/bin/env bash
# The whole path on a tiny built-in model, on 4 CPU ranks, with no downloads:
#   1. a tiny random Hugging Face Mixtral and a small learnable JSONL dataset are made locally;
#   2. the HF checkpoint is converted to a megatron-core distributed checkpoint;
#   3. LoRA is trained at PP2 x EP2 (4 ranks, gloo) until the loss has clearly dropped;
#   4. the adapter is exported in Hugging Face PEFT format (per-expert layout);
#   5. the adapter checkpoint, the PEFT adapter, TensorBoard logs and the loss plot are listed.
# Usage: bash examples/tiny_mixtral_cpu.sh [OUT_DIR]      (make demo runs it)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${1:-${OUT:-runs/tiny_mixtral}}
export PYTHONWARNINGS=ignore OMP_NUM_THREADS=1
rm -rf "$OUT"
mkdir -p "$OUT"

echo "== 1. tiny Mixtral (HF format) and data"
"$PY" tools/make_tiny_example.py --out "$OUT"

echo "== 2. convert HF -> megatron-core (torch_dist, loads at any layout)"
"$PY" -m megatron_lora convert hf-to-mcore --hf-dir "$OUT/hf" --save "$OUT/mcore" --no-progress

echo "== 3. LoRA training on 4 CPU ranks: PP2 x EP2"
"$PY" -m torch.distributed.run --nproc-per-node 4 --master-port "${PORT:-29535}" \
  -m megatron_lora train --load "$OUT/mcore" \
  --pipeline-model-parallel-size 2 --expert-model-parallel-size 2 \
  --data-path "$OUT/data.jsonl" --tokenizer byte --seq-length 64 \
  --micro-batch-size 2 --global-batch-size 8 --train-iters "${ITERS:-40}" \
  --lr 1e-2 --lr-warmup-iters 2 --lr-decay-style cosine --clip-grad 1.0 --seed 1 \
  --lora-rank 8 --lora-alpha 16 --lora-target-modules ${TARGETS:-linear_qkv linear_proj linear_fc1 linear_fc2} \
  --save "$OUT/lora" --save-interval 20 --log-interval 5 \
  --tensorboard-dir "$OUT/tensorboard" | tee "$OUT/train.log"

"$PY" - "$OUT/train.log" <<'PYEOF'
import re, sys
losses = [float(x) for x in re.findall(r"lm loss: ([0-9.E+-]+)", open(sys.argv[1]).read())]
first, last = losses[0], losses[-1]
print(f"== loss {first:.3f} -> {last:.3f} ({100 * (first - last) / first:.0f}% lower)")
sys.exit(0 if last < first * 0.9 else "the loss did not drop by 10%")
PYEOF
echo "== 4. export the adapter to Hugging Face PEFT format"
"$PY" -m megatron_lora export peft --adapter "$OUT/lora" --load-hf "$OUT/hf" --save "$OUT/peft"

echo "== outputs"
echo "adapter checkpoint: $OUT/lora/iter_$(printf %07d "$(cat "$OUT/lora/latest_checkpointed_iteration.txt")")"
echo "PEFT adapter:       $OUT/peft (adapter_model.safetensors, adapter_config.json)"
echo "tensorboard logs:   $OUT/tensorboard"
echo "loss curve:         $OUT/lora/loss_curve.png"
