#!/usr/bin/env bash
# The GPU check on one CUDA GPU (benchmarks/gpu_check.py says what it measures), with the
# machine's own Python by default and the figures in benchmarks/results/gpu_check-<UTC time>/:
#
#   bash benchmarks/gpu_check.sh              # PYTHON=<python> to choose the interpreter
#   bash benchmarks/gpu_check.sh --dry-run    # the same code on CPU at a tiny width
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m benchmarks.gpu_check \
  --out "benchmarks/results/gpu_check-$(date -u +%Y%m%dT%H%M%SZ)" "$@"
