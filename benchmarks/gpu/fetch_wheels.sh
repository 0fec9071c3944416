#!/usr/bin/env bash
# Download the wheels of benchmarks/gpu/wheels.txt for the GPU machine (CPython 3.12, x86-64
# manylinux) into .whl/ at the repository root, which .git/info/exclude keeps out of git.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
grep -v '^\s*#' benchmarks/gpu/wheels.txt | grep -v '^\s*$' | while read -r spec; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
ls -l .whl
