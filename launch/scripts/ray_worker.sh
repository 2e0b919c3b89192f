#!/bin/bash
# Start a Ray worker on this host: `python -m launch.cluster worker "$@"` run from the repository root, for job
# scripts of schedulers other than SLURM (PBS, LSF, your own). PYTHON picks the interpreter (default: python).
#   launch/scripts/ray_worker.sh --address 10.0.0.1:6379 --block
# Stop with `python -m launch.cluster stop` on the same host (or SIGTERM, with --block).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python}" -m launch.cluster worker "$@"
