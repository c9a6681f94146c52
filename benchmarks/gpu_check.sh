#!/usr/bin/env bash
# The GPU check on one CUDA GPU (benchmarks/gpu_check.py says what it measures), with the
# machine's own Python by default and the figures in benchmarks/results/gpu_check-<UTC time>/:
#
#   bash benchmarks/gpu_check.sh              # PYTHON=<python> to choose the interpreter
#   bash benchmarks/gpu_check.sh --dry-run    # the same code on CPU at a tiny width
#   bash benchmarks/gpu_check.sh --budget 480 # the parts by value that fit 480 s (default 540: one call)
#
# It checks Triton and a C compiler first and exits 1 naming what is missing before any part runs.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m benchmarks.gpu_check \
  --out "benchmarks/results/gpu_check-$(date -u +%Y%m%dT%H%M%SZ)" "$@"
