"""Drafters trained on vLLM's regenerated data and on transformers': `python -m benchmarks.regenerate_tau`.

The tiny demo target answers the demo's 96 training prompts and 8 held-out prompts twice, with `python -m
dflash_ops.data regenerate --engine hf` and `--engine vllm` (the venv of `make serve-check`), greedy, float32,
answers bounded by the demo config's data.max_length. A drafter is trained on each engine's data with each
seed (the demo's config, `--steps` steps, one thread) and evaluated (`python -m dflash_ops.evaluate`, greedy
speculative decoding around the target) on the same held-out prompts. The table: how many rows the
engines wrote alike, and each drafter's tau; the question is whether the engine moves tau by more than the
seed does. Minutes: not in `make bench`.

    python -m benchmarks.regenerate_tau [--steps 600] [--seeds 0,1] [--dir /tmp/bench-regenerate-tau]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from benchmarks.serve import KV_CACHE_GIB, SERVE_PYTHON, serve_venv_problem
from dflash_ops.data.chat_prompts import read_rows

REPO = Path(__file__).resolve().parent.parent
ENGINES = {"hf": ["--engine", "hf"], "vllm": ["--engine", "vllm", "--engine-python", str(SERVE_PYTHON)]}
NEW_TOKENS = 48


def run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} failed:\n{done.stderr[-4000:]}")
    return done


def regenerate(config: Path, target: Path, prompts: Path, out: Path, engine: str) -> dict:
    if not out.is_file():
        run([sys.executable, "-m", "dflash_ops.data", "regenerate", "--target", str(target),
             "--prompts", str(prompts), "--out", str(out), "--config", str(config), "--dtype", "float32",
             *ENGINES[engine]])
    return read_rows(out)


def train_and_tau(base: dict, data: Path, eval_data: Path, seed: int, steps: int, out: Path) -> float:
    config = {**base, "data": {**base["data"], "path": str(data), "eval_path": str(eval_data)},
              "optim": {**base["optim"], "total_steps": steps},
              "run": {**base["run"], "output_dir": str(out / "run"), "seed": seed, "resume": False,
                      "save_every": steps, "eval_every": steps, "log_every": steps},
              "pipeline": {**base["pipeline"], "threads_per_worker": 1}}
    path = out / "config.yaml"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    run([sys.executable, "-m", "dflash_ops.train", "--config", str(path), "--fresh"])
    done = run([sys.executable, "-m", "dflash_ops.evaluate", "--config", str(path),
                "--checkpoint", str(out / "run"), "--data", str(eval_data),
                "--max-new-tokens", str(NEW_TOKENS), "--threads", "1", "--no-target-row", "--json"])
    rows = {row["name"]: row for row in json.loads(done.stdout.splitlines()[-1])["rows"]}
    return rows["trained drafter"]["tau"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600,
                        help="optimizer steps of each drafter (default 600)")
    parser.add_argument("--seeds", default="0,1", help="the seeds each engine's data is trained with")
    parser.add_argument("--dir", type=Path, default=REPO / ".cache" / "bench-regenerate-tau")
    args = parser.parse_args(argv)
    problem = serve_venv_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    from pvesim.fleet import prepare_assets

    assets = prepare_assets()
    config, target = assets / "config.yaml", assets / "target"
    base = yaml.safe_load(config.read_text())
    out = args.dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data, taus = {}, {}
    for engine in ENGINES:
        data[engine] = {split: regenerate(config, target, assets / "data" / f"{prompts}.jsonl",
                                          out / f"{split}-{engine}.jsonl", engine)
                        for split, prompts in (("train", "prompts"), ("eval", "eval_prompts"))}
    same = {split: sum(data["hf"][split][i] == data["vllm"][split][i] for i in data["hf"][split])
            for split in ("train", "eval")}
    for engine in ENGINES:
        for seed in map(int, args.seeds.split(",")):
            taus[engine, seed] = train_and_tau(base, out / f"train-{engine}.jsonl", out / "eval-hf.jsonl",
                                               seed, args.steps, out / f"run-{engine}-{seed}")
    print(f"tiny demo target, greedy float32 regeneration: vLLM's rows equal transformers' on "
          f"{same['train']} of {len(data['hf']['train'])} training prompts and {same['eval']} of "
          f"{len(data['hf']['eval'])} held-out ones; drafters of {args.steps} steps, tau on the held-out "
          f"prompts ({NEW_TOKENS} new tokens)")
    print(f"{'data regenerated by':<22}" + "".join(f"{'seed ' + str(s):>10}" for s in args.seeds.split(","))
          + f"{'mean':>10}")
    for engine in ENGINES:
        values = [taus[key] for key in taus if key[0] == engine]
        print(f"{engine:<22}" + "".join(f"{v:>10.3f}" for v in values) + f"{statistics.mean(values):>10.3f}")
    print(json.dumps({"benchmark": "regenerate_tau", "steps": args.steps, "same_rows": same,
                      "tau": {f"{engine}/{seed}": tau for (engine, seed), tau in taus.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
