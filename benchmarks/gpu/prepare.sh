#!/usr/bin/env bash
# Here, before the one device call: the wheels run.sh installs there (fetch_wheels.sh, into
# .whl/) and the acceptance run's tiny models with their CPU losses (acceptance.py prepare, into
# benchmarks/gpu/.acceptance/). Both are kept out of git (.git/info/exclude); carry both to the
# GPU machine (about 45 MiB together).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
bash benchmarks/gpu/fetch_wheels.sh
grep -qx '/benchmarks/gpu/.acceptance/' .git/info/exclude 2>/dev/null ||
  echo '/benchmarks/gpu/.acceptance/' >> .git/info/exclude
rm -rf benchmarks/gpu/.acceptance
"$PY" benchmarks/gpu/acceptance.py prepare benchmarks/gpu/.acceptance
du -sh .whl benchmarks/gpu/.acceptance
