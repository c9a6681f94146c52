"""The demo drafter's tau with each loss weighting, the same steps: `python -m benchmarks.loss_weighting`.

`optim.loss_weighting: decay` (DFlash's fixed exp(-(k-1)/gamma)) against `dpace` (D-PACE's weights from
the drafter's own confidence, alpha 0.5), on the demo's assets (`dflash_ops.demo prepare`, default preset,
cached in `--dir`; its train.jsonl is the target's own greedy answers, what `dflash_ops.data regenerate`
writes), each trained from scratch in its own process (`python -m dflash_ops.train`, one thread, the demo's
config but `--steps` steps), then `python -m dflash_ops.evaluate` on the held-out prompts (greedy speculative
decoding, 64 new tokens each). Both runs take turns on the same machine, in one call; the table has
each one's tau, its acceptance by draft position and its training time, and the ratio dpace / decay.
Not in `make bench` (minutes of training): run it alone.

    python -m benchmarks.loss_weighting                      # 2000 steps each
    python -m benchmarks.loss_weighting --steps 4000 --dir /tmp/bench-weighting
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from dflash_ops.data.demo import prepare

REPO = Path(__file__).resolve().parent.parent
WEIGHTINGS = ("decay", "dpace")


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                         f"{done.stderr[-2000:]}")
    return done


def train_and_evaluate(config_path: Path, base: dict, weighting: str, steps: int, out: Path) -> dict:
    config = {**base, "optim": {**base["optim"], "total_steps": steps, "loss_weighting": weighting},
              "run": {**base["run"], "output_dir": str(out / f"run-{weighting}-{steps}"), "resume": False}}
    path = out / f"config-{weighting}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.monotonic()
    run([sys.executable, "-m", "dflash_ops.train", "--config", str(path)])
    train_s = time.monotonic() - started
    done = run([sys.executable, "-m", "dflash_ops.evaluate", "--config", str(path), "--checkpoint",
                config["run"]["output_dir"], "--threads", "1", "--no-target-row", "--json"])
    rows = {row["name"]: row for row in json.loads(done.stdout.splitlines()[-1])["rows"]}
    trained = rows["trained drafter"]
    return {"weighting": weighting, "steps": steps, "tau": round(trained["tau"], 3),
            "verify_steps": trained["verify_steps"],
            "acceptance_by_position": [round(r, 2) for r in trained["acceptance_by_position"]],
            "train_s": round(train_s, 1), "prompt_lookup_tau": round(rows["prompt lookup"]["tau"], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loss_weighting",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=str(REPO / ".cache" / "bench-loss-weighting"),
                        help="where the demo assets and the runs go (the assets are reused)")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps of each run (default 2000)")
    args = parser.parse_args(argv)
    out = Path(args.dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    config_path = prepare(out / "demo")
    base = yaml.safe_load(config_path.read_text())
    base["pipeline"]["threads_per_worker"] = 1
    results = [train_and_evaluate(config_path, base, weighting, args.steps, out) for weighting in WEIGHTINGS]
    print(f"the demo drafter after {args.steps} steps each, 64 new tokens per held-out prompt, greedy")
    print(f"{'weighting':<10} {'tau':>6} {'verify steps':>13} {'train s':>8}  "
          "acceptance at draft position 1..")
    for r in results:
        print(f"{r['weighting']:<10} {r['tau']:>6.2f} {r['verify_steps']:>13} {r['train_s']:>8.0f}  "
              + " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]))
    ratio = results[1]["tau"] / results[0]["tau"]
    print(f"tau, dpace / decay: {ratio:.3f}x "
          f"(prompt lookup, no training: {results[0]['prompt_lookup_tau']:.2f})")
    print(json.dumps({"benchmark": "loss_weighting", "steps": args.steps, "runs": results,
                      "dpace_over_decay_tau": round(ratio, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
