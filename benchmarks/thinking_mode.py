"""The demo drafter's tau when its training and evaluation thinking modes match and when they do not, and
with SpecForge's minimum-length filter: `python -m benchmarks.thinking_mode`.

On the demo's assets (`dflash.demo prepare`, default preset, cached in `--dir`), `python -m dflash.data
regenerate` answers the training and the held-out prompts once in each mode (`--enable-thinking false`:
the demo template closes an empty think block, as Qwen3's does; `true`: the prompt ends with the user's
text). Three drafters are trained from scratch, the same steps, one thread each (`python -m dflash.train`,
the demo's config): on the non-thinking data, on the thinking data, and on the non-thinking data with
`data.min_loss_tokens: 2 * block_size` (SpecForge's filter before 7757409f). Each is exported (`python -m
dflash.export`) and evaluated (`python -m dflash.evaluate`, greedy, 64 new tokens per held-out prompt) on
the held-out prompts of both modes: the table puts the matched and mismatched tau side by side. All in one
call, at most `--jobs` processes at a time. Not in `make bench` (minutes of training): run it alone.

    python -m benchmarks.thinking_mode                       # 1500 steps each
    python -m benchmarks.thinking_mode --steps 4000 --dir /tmp/bench-thinking
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from benchmarks.loss_weighting import REPO, run
from dflash.data.data_manifest import manifest_path, mode_name
from dflash.data.demo import PRESETS, prepare
from dflash.data.examples import load_examples

MODES = (False, True)


def label(mode: bool) -> str:
    return "thinking" if mode else "non-thinking"


def regenerate(demo: Path, mode: bool, out: Path) -> dict[str, Path]:
    """The training and held-out rows of `mode` (kept from an earlier call when finished)."""
    paths = {}
    for split, prompts in (("train", "prompts.jsonl"), ("eval", "eval_prompts.jsonl")):
        path = out / f"data-{label(mode)}" / f"{split}.jsonl"
        if not manifest_path(path).is_file():
            run([sys.executable, "-m", "dflash.data", "regenerate", "--target", str(demo / "target"),
                 "--prompts", str(demo / "data" / prompts), "--out", str(path), "--enable-thinking",
                 mode_name(mode), "--max-new-tokens", "64", "--batch-size", "32", "--threads", "1"])
        paths[split] = path
    return paths


def train_export(base: dict, name: str, data: dict[str, Path], mode: bool, steps: int, out: Path,
                 min_loss_tokens: int | None = None) -> Path:
    config = {**base,
              "data": {**base["data"], "path": str(data["train"]), "eval_path": str(data["eval"]),
                       "enable_thinking": mode, "min_loss_tokens": min_loss_tokens,
                       # The non-thinking prompts are four tokens longer, and a re-tokenized prompt may be
                       # longer than the window it was cut as: no row is cut short.
                       "max_length": 2 * base["data"]["max_length"]},
              "optim": {**base["optim"], "total_steps": steps},
              "run": {**base["run"], "output_dir": str(out / f"run-{name}-{steps}"), "resume": False}}
    path = out / f"config-{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    run([sys.executable, "-m", "dflash.train", "--config", str(path)])
    run([sys.executable, "-m", "dflash.export", "--checkpoint", config["run"]["output_dir"], "--out",
         str(out / f"export-{name}-{steps}")])
    return path


def tau_on(config: Path, eval_data: Path) -> dict:
    output_dir = yaml.safe_load(config.read_text())["run"]["output_dir"]
    done = run([sys.executable, "-m", "dflash.evaluate", "--config", str(config), "--checkpoint", output_dir,
                "--data", str(eval_data), "--threads", "1", "--no-target-row", "--json"])
    rows = {row["name"]: row for row in json.loads(done.stdout.splitlines()[-1])["rows"]}
    return {"tau": round(rows["trained drafter"]["tau"], 3),
            "acceptance_by_position": [round(r, 2)
                                       for r in rows["trained drafter"]["acceptance_by_position"]],
            "prompt_lookup_tau": round(rows["prompt lookup"]["tau"], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.thinking_mode",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=str(REPO / ".cache" / "bench-thinking-mode"),
                        help="where the demo assets, the regenerated data and the runs go (the first two "
                             "are reused)")
    parser.add_argument("--steps", type=int, default=1500, help="optimizer steps of each run (default 1500)")
    parser.add_argument("--jobs", type=int, default=2, help="processes at a time (default 2)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default",
                        help="the demo's sizes (default: default; tiny: a check of the steps in seconds)")
    args = parser.parse_args(argv)
    out = Path(args.dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    demo = prepare(out / f"demo-{args.preset}", PRESETS[args.preset]).parent
    base = yaml.safe_load((demo / "config.yaml").read_text())
    base["pipeline"]["threads_per_worker"] = 1
    minimum = 2 * base["model"]["block_size"]
    with ThreadPoolExecutor(args.jobs) as pool:
        data = dict(zip(MODES, pool.map(lambda mode: regenerate(demo, mode, out), MODES), strict=True))
        runs = ([(label(mode), mode, None) for mode in MODES]
                + [(f"{label(False)}-min{minimum}", False, minimum)])
        configs = list(pool.map(lambda r: train_export(base, r[0], data[r[1]], r[1], args.steps, out, r[2]),
                                runs))
        evals = [(config, mode, trained)
                 for config, (_, trained, minimum_of) in zip(configs, runs, strict=True)
                 for mode in MODES if minimum_of is None or mode == trained]
        taus = list(pool.map(lambda e: tau_on(e[0], data[e[1]]["eval"]), evals))
    max_length = 2 * base["data"]["max_length"]
    rows_of = {mode: len(load_examples(data[mode]["train"], max_length)) for mode in MODES}
    kept = len(load_examples(data[False]["train"], max_length, min_loss_tokens=minimum))
    results = []
    for (config, evaluated, trained), figures in zip(evals, taus, strict=True):
        name = next(n for (n, _, _), c in zip(runs, configs, strict=True) if c == config)
        results.append({"run": name, "trained": label(trained), "evaluated": label(evaluated),
                        "match": evaluated == trained, **figures})
    print(f"the demo drafter after {args.steps} steps each, 64 new tokens per held-out prompt "
          f"({sum(1 for _ in data[False]['eval'].open())} per mode), greedy")
    print(f"{'run (training data)':<24} {'evaluated on':<14} {'tau':>6} {'prompt lookup':>14}  "
          "acceptance at draft position 1..")
    for r in results:
        print(f"{r['run']:<24} {r['evaluated']:<14} {r['tau']:>6.2f} {r['prompt_lookup_tau']:>14.2f}  "
              + " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]))
    tau = {(r["run"], r["evaluated"]): r["tau"] for r in results}
    for mode in MODES:
        own, other = label(mode), label(not mode)
        print(f"trained {own}: tau on {other} prompts / on {own} prompts: "
              f"{tau[(own, other)] / tau[(own, own)]:.3f}x")
    filtered = f"{label(False)}-min{minimum}"
    print(f"min_loss_tokens {minimum}: keeps {kept} of {rows_of[False]} training rows; tau "
          f"{tau[(filtered, label(False))]:.2f} against {tau[(label(False), label(False))]:.2f} without")
    print(json.dumps({"benchmark": "thinking_mode", "steps": args.steps, "runs": results,
                      "training_rows": {label(m): n for m, n in rows_of.items()},
                      "min_loss_tokens": {"value": minimum, "kept_rows": kept}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
