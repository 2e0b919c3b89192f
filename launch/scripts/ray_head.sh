#!/bin/bash
# Start a Ray head on this host: `python -m launch.cluster head "$@"` run from the repository root, for job
# scripts of schedulers other than SLURM (PBS, LSF, your own). PYTHON picks the interpreter (default: python).
#   launch/scripts/ray_head.sh --node-ip-address 10.0.0.1 --port 6379
# Stop with `python -m launch.cluster stop` on the same host (or SIGTERM, with --block).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python}" -m launch.cluster head "$@"
