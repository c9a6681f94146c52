"""A drafter served in the thinking mode it was not trained in: `python -m benchmarks.thinking_mode`.

The thinking demo's target (`dflash_ops.demo prepare --preset thinking`: the demo target taught Qwen3's two
chat modes, `dflash_ops.data.demo_thinking`) answers its training and held-out prompts in each mode
(`python -m dflash_ops.data regenerate --enable-thinking false|true`, greedy, 64 new tokens); a drafter is
trained on each mode's data (the demo's config, `data.enable_thinking` set to the mode, `--steps`
steps, one thread), exported (`python -m dflash_ops.export`, whose config.json records the mode), and each
is evaluated (`python -m dflash_ops.evaluate`, greedy speculative decoding, 64 new tokens) on the held-out
prompts in both modes, all in one call. The table is tau by training mode and serving mode, and the
ratio of each drafter's tau in the other mode to its tau in its own. Not in `make bench` (minutes of
regeneration and training): run it alone.

    python -m benchmarks.thinking_mode                      # 2000 steps each
    python -m benchmarks.thinking_mode --steps 4000 --dir /tmp/bench-thinking
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

from benchmarks.loss_weighting import run
from dflash_ops.data.demo import PRESETS, prepare

REPO = Path(__file__).resolve().parent.parent
MODES = ("false", "true")
NEW_TOKENS = 64


def regenerate(target: Path, prompts: Path, out: Path, mode: str) -> Path:
    if not out.is_file():
        run([sys.executable, "-m", "dflash_ops.data", "regenerate", "--target", str(target), "--prompts",
             str(prompts), "--out", str(out), "--enable-thinking", mode, "--max-new-tokens", str(NEW_TOKENS),
             "--engine", "hf", "--dtype", "float32",
             "--batch-size", "32", "--threads", "1"])
    return out


def train_and_export(base: dict, data: Path, mode: str, steps: int, out: Path) -> tuple[Path, dict]:
    """The config of a drafter trained on `mode`'s data, and its export's `dflash_training`."""
    config = {**base,
              "data": {**base["data"], "path": str(data / "train.jsonl"),
                       "eval_path": str(data / "eval.jsonl"), "enable_thinking": mode == "true"},
              "optim": {**base["optim"], "total_steps": steps},
              "run": {**base["run"], "output_dir": str(out / f"run-thinking-{mode}-{steps}"),
                      "resume": False}}
    path = out / f"config-thinking-{mode}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.monotonic()
    run([sys.executable, "-m", "dflash_ops.train", "--config", str(path)])
    config["train_s"] = round(time.monotonic() - started, 1)
    export = out / f"export-thinking-{mode}"
    run([sys.executable, "-m", "dflash_ops.export", "--checkpoint", config["run"]["output_dir"],
         "--out", str(export)])
    return path, json.loads((export / "config.json").read_text())["dflash_training"]


def tau(config_path: Path, eval_data: Path) -> dict:
    done = run([sys.executable, "-m", "dflash_ops.evaluate", "--config", str(config_path), "--checkpoint",
                yaml.safe_load(config_path.read_text())["run"]["output_dir"], "--data", str(eval_data),
                "--max-new-tokens", str(NEW_TOKENS), "--threads", "1", "--no-target-row", "--json"])
    rows = {row["name"]: row for row in json.loads(done.stdout.splitlines()[-1])["rows"]}
    trained = rows["trained drafter"]
    return {"tau": round(trained["tau"], 3),
            "acceptance_by_position": [round(r, 2) for r in trained["acceptance_by_position"]],
            "prompt_lookup_tau": round(rows["prompt lookup"]["tau"], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.thinking_mode",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=str(REPO / ".cache" / "bench-thinking-mode"),
                        help="where the assets, the regenerated data and the runs go (both are reused)")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps of each run (default 2000)")
    parser.add_argument("--preset", choices=("thinking", "tiny-thinking"), default="thinking",
                        help="the demo assets (tiny-thinking: a quick check of the benchmark itself)")
    args = parser.parse_args(argv)
    out = Path(args.dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(prepare(out / "demo", PRESETS[args.preset]).read_text())
    base["pipeline"]["threads_per_worker"] = 1
    target, chats = out / "demo" / "target", out / "demo" / "data"
    data = {}
    for mode in MODES:
        data[mode] = out / f"data-thinking-{mode}"
        data[mode].mkdir(exist_ok=True)
        regenerate(target, chats / "prompts.jsonl", data[mode] / "train.jsonl", mode)
        regenerate(target, chats / "eval_prompts.jsonl", data[mode] / "eval.jsonl", mode)
    results = []
    for trained in MODES:
        config_path, recorded = train_and_export(base, data[trained], trained, args.steps, out)
        for served in MODES:
            results.append({"trained": trained, "served": served, "export_records": recorded,
                            **tau(config_path, data[served] / "eval.jsonl")})
    print(f"the thinking demo's drafters after {args.steps} steps each, {NEW_TOKENS} new tokens per held-out "
          "prompt, greedy")
    print(f"{'trained in':<22} {'served in':<22} {'tau':>6}  acceptance at draft position 1..")
    for r in results:
        names = [("thinking" if r[key] == "true" else "non-thinking") for key in ("trained", "served")]
        print(f"{names[0]:<22} {names[1]:<22} {r['tau']:>6.2f}  "
              + " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]))
    by = {(r["trained"], r["served"]): r["tau"] for r in results}
    ratios = {trained: round(by[trained, other] / by[trained, trained], 3)
              for trained, other in (("false", "true"), ("true", "false"))}
    print(f"tau in the other mode / in its own: non-thinking drafter {ratios['false']:.3f}x, "
          f"thinking drafter {ratios['true']:.3f}x")
    print(json.dumps({"benchmark": "thinking_mode", "steps": args.steps, "runs": results,
                      "other_over_own_tau": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
