#!/usr/bin/env bash
# On the GPU machine, from a copy of the repository with .whl/ beside it (fetch_wheels.sh):
# install the missing wheels into /tmp/site, then run the one-shot check with the qlora mode
# (--base-quantization nf4; arguments go to this call), then the DeepSeek-V3 layer shape's frozen
# and lora modes (2 MoE layers of 256 experts, multi-latent attention: about 50 GB of bf16
# weights; 5 timed steps). Prints each call's table and JSON line; finishes in a few minutes on
# an H200.
set -euo pipefail
cd "$(dirname "$0")/../.."
if ! python3 -c "import megatron.core, bitsandbytes" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
PYTHONUNBUFFERED=1 python3 benchmarks/gpu/check.py --base-quantization nf4 "$@"
PYTHONUNBUFFERED=1 python3 benchmarks/gpu/check.py --shape deepseek-v3 --steps 5 --warmup 2
