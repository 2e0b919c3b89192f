#!/usr/bin/env bash
# The GPU check: one JSON line (launch/gpu_check.py says what it measures).
#   bash launch/gpu_check.sh            # on a CUDA machine: NCCL, a ~1B Llama at bf16
#   bash launch/gpu_check.sh --dry-run  # anywhere: CPU + gloo at a tiny size
# The one-GPU machine (FACTS.md "The GPU machine") has torch and transformers but no megatron-core: carry its
# pure-Python wheel in .whl/ and this script installs it into .mcore/ (no network needed, no deps pulled).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
if ! "$PY" -c "import megatron.core" 2>/dev/null; then
  whl=$(ls .whl/megatron_core-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$whl" ]; then echo '{"check": "launch/gpu_check", "ok": false, "error": "no megatron-core: put its wheel in .whl/"}'; exit 2; fi
  "$PY" -m pip install --quiet --no-deps --no-index --target .mcore "$whl" >&2
  export PYTHONPATH=$PWD/.mcore${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Each part has its own timeout inside; this one bounds the whole check.
exec timeout 560 "$PY" launch/gpu_check.py --timeout 170 "$@"
