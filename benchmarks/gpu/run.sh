#!/usr/bin/env bash
# On the GPU machine, from a copy of the repository with .whl/ and benchmarks/gpu/.acceptance/
# beside it (prepare.sh made both here): install the missing wheels into /tmp/site, then, each
# under its own time limit and whatever failed before it:
#   1. the acceptance run (acceptance.py run): every family's tiny model through every command
#      on the GPU against the CPU's losses and transformers / PEFT;
#   2. the GPU check at Mixtral-8x7B layer shapes with the qlora mode (arguments go to this call)
#      and the transformers + PEFT peer;
#   3. the GPU check at Qwen3-30B-A3B layer shapes with the qlora mode, and the peer;
#   4. the GPU check at DeepSeek-V3 layer shapes (2 MoE layers of 256 experts, multi-latent
#      attention: about 50 GB of bf16 weights; 5 timed steps; frozen, floor, lora).
# Prints each part's table and JSON line; exits non-zero if any part failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
if ! python3 -c "import megatron.core, bitsandbytes" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
status=0
part() {  # part SECONDS COMMAND...: run it under a limit, remember a failure, go on
  local limit=$1; shift
  echo "== $* (limit ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" || { echo "== exit $? from: $*"; status=1; }
}
part 210 python3 benchmarks/gpu/acceptance.py run benchmarks/gpu/.acceptance
# --time-budget: a check skips the modes that would run past its part's limit (less a margin for
# its start and its report), so that its JSON line still comes.
part 150 python3 benchmarks/gpu/check.py --base-quantization nf4 --time-budget 135 "$@"
part 90 python3 benchmarks/gpu/check.py --shape qwen3-30b-a3b --steps 5 --base-quantization nf4 \
  --time-budget 75
part 100 python3 benchmarks/gpu/check.py --shape deepseek-v3 --steps 5 --warmup 2 --time-budget 85
exit $status
