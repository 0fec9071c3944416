#!/usr/bin/env bash
# Create (or complete) a virtual environment for this project, pinned by constraints.txt.
#
#   tools/setup_venv.sh VENV [MCORE]
#
# Without MCORE: the megatron-core release constraints.txt pins for the running Python (the newest
# with a wheel for it: 0.16.1 on Python 3.11, the 0.19 series on 3.12+).
# With MCORE (for example 0.19.2): that release instead. Where the running Python is older than
# the release declares (0.17+ declare Python >= 3.12; they build and run on 3.11), it is built from
# its sdist without build isolation, against the already pinned numpy.
# Either way, a megatron-core that imports triton (0.19: moe/ops/paged_stash.py) gets the pinned
# triton when the torch build (CPU) did not bring it.
set -euo pipefail
VENV=${1:?usage: tools/setup_venv.sh VENV [MCORE]}
MCORE=${2:-}
PYTHON=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0}
cd "$(dirname "$0")/.."
# One line per step, so that the few quiet minutes of an install say what they are doing.
say() { echo "setup ($VENV): $*"; }

if ! test -x "$VENV/bin/python"; then
  say "creating the virtual environment with $("$PYTHON" -V 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q)
# CPU torch first and alone, so that no dependency pulls a CUDA build.
say "installing $TORCH (CPU build)"
"${PIP[@]}" "$TORCH"

CONSTRAINTS=constraints.txt
if [ -n "$MCORE" ]; then
  CONSTRAINTS="$VENV/constraints-mcore$MCORE.txt"
  { grep -v '^megatron-core' constraints.txt; echo "megatron-core==$MCORE"; } > "$CONSTRAINTS"
  if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('megatron-core') != '$MCORE')" 2>/dev/null; then
    say "installing megatron-core $MCORE"
    if ! "${PIP[@]}" --no-deps "megatron-core==$MCORE" 2>/dev/null; then
      echo "megatron-core $MCORE has no wheel for $("$PY" -V); building it from its sdist"
      SDIST=$(mktemp -d)
      "$PY" -m pip download -q --no-deps --no-binary :all: --ignore-requires-python \
        -d "$SDIST" "megatron-core==$MCORE"
      "${PIP[@]}" -c "$CONSTRAINTS" numpy pybind11 "setuptools>=80" wheel packaging
      "${PIP[@]}" --no-build-isolation --no-deps --ignore-requires-python "$SDIST"/megatron_core-*.tar.gz
      rm -rf "$SDIST"
    fi
  fi
fi

say "installing megatron-lora (editable) and its pinned dependencies from $CONSTRAINTS"
"${PIP[@]}" -c "$CONSTRAINTS" -e '.[test,hf]'
say "checking that megatron-core imports"
# (The import's output is captured first: under pipefail a failing python | grep is false.)
why=$("$PY" -c "import megatron.core.models.gpt.gpt_model" 2>&1) || true
case "$why" in
  *"No module named 'triton'"*) say "installing triton (megatron-core imports it)"
                                "${PIP[@]}" -c "$CONSTRAINTS" triton ;;
esac
"$PY" -c "import megatron.core.models.gpt.gpt_model" 2>/dev/null || {
  "$PY" -c "import megatron.core.models.gpt.gpt_model"; exit 1; }
# (its import warns that Transformer Engine and apex are absent: optional, CPU runs need neither)
PYTHONWARNINGS=ignore "$PY" -c "import megatron.core as m; print('setup ($VENV): ready, megatron-core', m.__version__)"
touch "$VENV/.installed"
