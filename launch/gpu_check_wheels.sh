#!/usr/bin/env bash
# Fills .whl/ with what launch/gpu_check.sh needs on the lent GPU machine and that machine lacks (FACTS.md, "The GPU
# machine": Python 3.12, torch 2.11, transformers, no network): megatron-core and omegaconf, as wheels for its Python.
# Run it here (it needs the package registry), then hand .whl to the device tool's `carry` (64 MiB a call; these
# are ~3 MiB). Both install there with --no-deps: megatron-core needs torch, numpy and packaging, omegaconf PyYAML,
# and transformers brings all three.
#   bash launch/gpu_check_wheels.sh                 # megatron-core as pinned here (0.16.1), for CPython 3.12
#   MCORE_VERSION=0.19.2 bash launch/gpu_check_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=$(command -v python3)
GPU_PYTHON=${GPU_PYTHON:-3.12}
MCORE_VERSION=${MCORE_VERSION:-$("$PY" -c 'import importlib.metadata as m; print(m.version("megatron-core"))' 2>/dev/null || echo 0.16.1)}
OMEGACONF_VERSION=${OMEGACONF_VERSION:-$("$PY" -c 'import importlib.metadata as m; print(m.version("omegaconf"))' 2>/dev/null || echo 2.4.0)}
mkdir -p .whl
rm -f .whl/megatron_core-*.whl .whl/omegaconf-*.whl
# megatron-core ships compiled helpers: the wheel must match the GPU machine's CPython, not this one's.
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest .whl \
  --python-version "$GPU_PYTHON" --platform manylinux_2_28_x86_64 "megatron-core==$MCORE_VERSION"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest .whl "omegaconf==$OMEGACONF_VERSION"
ls -l .whl/*.whl
total=$(du -cb .whl/*.whl | tail -n 1 | cut -f1)
echo "gpu_check_wheels: $total bytes in .whl/ (the device tool carries up to 64 MiB a call)"
[ "$total" -lt $((64 * 1024 * 1024)) ]
