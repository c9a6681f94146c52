"""Run every benchmark with its default sizes: `python -m benchmarks [--only NAME ...]`.

Each benchmark is a script that prints a human table and, as its last line, one JSON object with
its figures. This runner starts each in its own process (so one's memory and threads cannot skew
another's), streams its output, keeps the JSON line in `benchmarks/results/<name>.json`, and ends
with each benchmark's wall time and the total (BENCHMARKS.md has the last figures).
Larger or smaller sizes: run a script alone with the flags of its `--help`. Two run only alone, for
what they need: `benchmarks.gpu_check` a CUDA GPU, `benchmarks.serve` vLLM's venv (`make serve-check`).
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ("hidden_states", "target_capture", "heldout_capture", "attention", "drafter_rank", "pipeline",
         "members", "restart_cycle", "fleet", "drafter_step", "drafter_kernels", "feature_cache",
         "checkpoint_write")


def run_one(name: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *extra]
    print(f"\n=== {name}: {' '.join(cmd[2:])}", flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=HERE.parent)
    last = ""
    for line in proc.stdout:
        print(line, end="", flush=True)
        if line.strip():
            last = line
    if proc.wait() != 0:
        raise SystemExit(f"benchmark {name} failed with exit status {proc.returncode}")
    try:
        figures = json.loads(last)
    except json.JSONDecodeError:
        raise SystemExit(f"benchmark {name} did not end with a JSON line: {last!r}") from None
    figures["_wall_s"] = round(time.monotonic() - started, 1)
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    (results / f"{name}.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=ORDER, help="run only these benchmarks")
    args = parser.parse_args(argv)
    started = time.monotonic()
    walls = {name: run_one(name, [])["_wall_s"] for name in args.only or ORDER}
    print(f"\nfigures written to {HERE / 'results'}/")
    print("wall time: " + ", ".join(f"{name} {wall:.0f} s" for name, wall in walls.items())
          + f"; total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
