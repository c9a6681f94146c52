#!/usr/bin/env bash
# The GPU path on a CUDA machine, in one go (under 10 minutes on a box with >= 2 GPUs):
#   1. the pipeline through torchrun on 2+ GPUs with nccl: bf16 target, fp32-master drafter
#      (model.dtype bfloat16), half the GPUs per role; steady-state tokens/s, a SIGTERM stop that
#      checkpoints and exits 0, and a resume;
#   2. the GPU rows of the hidden-state benchmark (the CUDA allocator's peak);
#   3. the GPU tests (the tests that skip without CUDA: packed hidden states, the nccl pipeline).
# Figures go to stdout and to $GPU_CHECK_OUT (default benchmarks/results/gpu_check-<UTC time>.txt),
# for BENCHMARKS.md. Without CUDA (or with fewer than 2 GPUs) it says so and exits 1: it never
# reports figures it did not measure.
#
#   PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
OUT="${GPU_CHECK_OUT:-benchmarks/results/gpu_check-$(date -u +%Y%m%dT%H%M%SZ).txt}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! [ -x "$PYTHON" ]; then
  echo "gpu_check: no Python at $PYTHON (make setup, or PYTHON=<venv>/bin/python). Nothing was measured." >&2
  exit 1
fi

gpus="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')"
if [ "$gpus" -lt 2 ]; then
  echo "gpu_check: this machine has $gpus usable CUDA GPU(s) (torch $("$PYTHON" -c 'import torch; print(torch.__version__)')); the GPU check needs at least 2. Nothing was measured." >&2
  exit 1
fi
mkdir -p "$(dirname "$OUT")"
exec > >(tee "$OUT") 2>&1
echo "# gpu_check $(date -u +%FT%TZ): $gpus GPUs"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())))'

echo "## 1. pipeline on GPUs (torchrun, nccl, bf16 target, fp32-master drafter)"
timeout 120 "$PYTHON" -m dflash.demo prepare "$WORK/demo" --preset tiny > /dev/null
"$PYTHON" - "$WORK" "$gpus" <<'EOF'
import sys
from pathlib import Path

import yaml

work, gpus = Path(sys.argv[1]), int(sys.argv[2])
raw = yaml.safe_load((work / "demo" / "config.yaml").read_text())
drafters = max(1, gpus // 2)
raw["model"]["dtype"] = "bfloat16"
raw["data"].update(batch_size=8)
raw["optim"].update(total_steps=400, warmup_ratio=0.0)
raw["run"].update(output_dir=str(work / "run"), save_every=100, log_every=1)
raw["pipeline"] = {"device": "cuda", "drafter_gpus": list(range(drafters)),
                   "target_gpus": list(range(drafters, gpus)), "max_restarts": 0}
(work / "gpu.yaml").write_text(yaml.safe_dump(raw))
EOF
# A full run of 400 steps, a run stopped by SIGTERM to its process group, and its resume.
timeout 300 "$PYTHON" -m dflash.train --config "$WORK/gpu.yaml" > "$WORK/full.log" 2>&1 \
  || { tail -40 "$WORK/full.log"; echo "gpu_check: FAILED: the GPU pipeline run"; exit 1; }
rm -rf "$WORK/run"
setsid "$PYTHON" -m dflash.train --config "$WORK/gpu.yaml" > "$WORK/stop.log" 2>&1 &
leader=$!
for _ in $(seq 600); do grep -q '"event": "step", .*"step": 20,' "$WORK/stop.log" && break; sleep 0.2; done
kill -TERM -- "-$leader"
stop_code=0; wait "$leader" || stop_code=$?
timeout 300 "$PYTHON" -m dflash.train --config "$WORK/gpu.yaml" > "$WORK/resume.log" 2>&1 \
  || { tail -40 "$WORK/resume.log"; echo "gpu_check: FAILED: the resumed GPU run"; exit 1; }
"$PYTHON" - "$WORK" "$stop_code" <<'EOF'
import json
import statistics
import sys
from pathlib import Path

work, stop_code = Path(sys.argv[1]), int(sys.argv[2])


def events(name):
    return [json.loads(line) for line in (work / name).read_text().splitlines() if line.startswith("{")]


full = events("full.log")
steps = [e for e in full if e["event"] == "step"]
devices = sorted({e["device"] for e in full if e["event"] == "start" and "device" in e})
rates = [e["tokens_per_s"] for e in steps[20:]]
assert len(steps) == 400, f"{len(steps)} steps logged"
print(f"workers' devices: {devices}")
print(f"drafter tokens/s (steady state, steps 21-400): median {statistics.median(rates):,.0f}, "
      f"best {max(rates):,.0f}; loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.3f}")
stop = events("stop.log")
checkpoints = [e["step"] for e in stop if e["event"] == "checkpoint"]
status = json.loads((work / "run" / "status.json").read_text())
resume = [e["step"] for e in events("resume.log") if e["event"] == "resume"]
print(f"SIGTERM stop: exit {stop_code}, checkpoint at step {checkpoints[-1] if checkpoints else None}; "
      f"resumed at {resume}; final state {status['state']} at step {status['step']}")
assert stop_code == 0 and checkpoints and resume == checkpoints[-1:] and status["step"] == 400
EOF

echo "## 2. hidden-state benchmark, GPU rows"
timeout 240 "$PYTHON" -m benchmarks.hidden_states --device cuda --no-plot

echo "## 3. GPU tests"
timeout 240 "$PYTHON" -m pytest -q -p no:cacheprovider tests/dflash tests/pipeline -k "cuda or gpus"
echo "gpu_check: OK ($OUT)"
