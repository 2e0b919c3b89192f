#!/usr/bin/env bash
# The GPU check: one JSON line (launch/gpu_check.py says what it measures).
#   bash launch/gpu_check.sh            # on a CUDA machine: NCCL, a ~1B Llama at bf16
#   bash launch/gpu_check.sh --dry-run  # anywhere: CPU + gloo at a tiny size
# The one-GPU machine (FACTS.md "The GPU machine") has torch and transformers but neither megatron-core nor
# omegaconf, and no network: launch/gpu_check_wheels.sh puts their wheels in .whl/ here, the device tool carries
# .whl/, and this script installs whichever of them is missing into .gpu_site/ (offline, no deps pulled).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
for pair in megatron.core:megatron_core omegaconf:omegaconf; do
  module=${pair%%:*} wheel=${pair#*:}
  PYTHONPATH=$PWD/.gpu_site${PYTHONPATH:+:$PYTHONPATH} "$PY" -c "import $module" 2>/dev/null && continue
  whl=$(ls .whl/"$wheel"-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$whl" ]; then
    echo "{\"check\": \"launch/gpu_check\", \"ok\": false, \"error\": \"no $module: run launch/gpu_check_wheels.sh and carry .whl/\"}"
    exit 2
  fi
  # A wheel is a zip laid out as site-packages: where pip is missing, unpacking it is the install.
  "$PY" -m pip install --quiet --no-deps --no-index --target .gpu_site "$whl" >&2 || "$PY" -m zipfile -e "$whl" .gpu_site
done
[ -d .gpu_site ] && export PYTHONPATH=$PWD/.gpu_site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Each part has its own timeout inside; this one bounds the whole check.
exec timeout 560 "$PY" launch/gpu_check.py --timeout 170 "$@"
