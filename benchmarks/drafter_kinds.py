"""DFlash (CE), DFlash distilled and DSpark on the demo side by side: `python -m benchmarks.drafter_kinds`.

Three drafters of the demo's target, each trained from scratch in its own process
(`python -m dflash_ops.train`, one thread, the demo's config but `--steps` steps, the same data, seed and
block size):
- `dflash-ce`: DFlash, `loss.kind: ce` (the hard labels: the target's greedy answers);
- `dflash-distilled`: DFlash, `loss.kind: mix` `{ce: 0.1, tvd: 0.9}` against the target's distribution
  (its last hidden state sent with the features: dflash_ops.model.distill);
- `dspark`: `model.kind: dspark` (rank `--markov-rank`, the confidence head) with Model-Optimizer's
  `{ce: 0.1, tvd: 0.9, bce: 1.0}` (dflash_ops.model.dspark).
Then greedy speculative decoding of the held-out prompts (64 new tokens each, `dflash_ops.serve.evaluate`'s
verify loop, lossless whatever the drafts) with each, and prompt lookup beside them. tau by the engines' rule
(tokens gained per verify step, the target's own included): a DFlash drafter of block b drafts b - 1 tokens
a step (vLLM's num_speculative_tokens b - 1), a DSpark one b (its block's every position, then the Markov
head left to right: vLLM's DSparkProposer), so their taus are bounded by b and b + 1. The cost per step:
each run's training time over its steps (process start included), and, steadier on a shared machine, the
median of `--rounds` optimizer steps of the three trainers taken in turn in this process, each on the
same precomputed batch (the drafter's step alone: forward, loss, backward, AdamW). Not in `make bench`.

    python -m benchmarks.drafter_kinds                        # 1000 steps each
    python -m benchmarks.drafter_kinds --steps 2000 --dir /tmp/bench-kinds
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

from dflash_ops.core.config import load_config
from dflash_ops.core.loss_section import capture_layer_ids
from dflash_ops.data.demo import PRESETS, prepare
from dflash_ops.data.examples import training_examples
from dflash_ops.data.target import TargetHead, load_target, step_features
from dflash_ops.model.acceptance import AcceptanceStats
from dflash_ops.serve.baselines import prompt_lookup_proposer
from dflash_ops.serve.evaluate import (
    end_of_text_id,
    eval_prompts,
    heldout_path,
    kind_proposer,
    speculative_decode,
)
from dflash_ops.training.checkpoint import latest_checkpoint, load_checkpoint
from dflash_ops.training.trainer import DrafterTrainer, build_drafter, resolve_layer_ids

REPO = Path(__file__).resolve().parent.parent
MAX_NEW_TOKENS = 64


def kinds(markov_rank: int) -> dict[str, dict]:
    return {
        "dflash-ce": {},
        "dflash-distilled": {"loss": {"kind": "mix", "weights": {"ce": 0.1, "tvd": 0.9}}},
        "dspark": {"model": {"kind": "dspark", "markov_rank": markov_rank, "confidence_head": True},
                   "loss": {"kind": "mix", "weights": {"ce": 0.1, "tvd": 0.9, "bce": 1.0}}},
    }


def run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n"
                         f"{done.stderr[-2000:]}")


def train(base: dict, name: str, sections: dict, steps: int, out: Path) -> tuple[Path, float]:
    config = {**base, "optim": {**base["optim"], "total_steps": steps},
              "run": {**base["run"], "output_dir": str(out / f"run-{name}-{steps}"), "resume": False,
                      "save_every": steps},
              "data": {**base["data"], "eval_path": None}}
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    shutil.rmtree(config["run"]["output_dir"], ignore_errors=True)  # this benchmark's own earlier run
    path = out / f"config-{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    started = time.monotonic()
    run([sys.executable, "-m", "dflash_ops.train", "--config", str(path)])
    return path, time.monotonic() - started


def decode(target, propose, prompts, layer_ids, block_size, name) -> AcceptanceStats:
    stats = AcceptanceStats(name, block_size)
    for prompt in prompts:
        speculative_decode(target, propose, prompt, layer_ids, block_size, MAX_NEW_TOKENS,
                           end_of_text_id(target), stats)
    return stats


def interleaved_step_ms(configs: dict, target, rounds: int) -> dict[str, float]:
    """The median milliseconds of one optimizer step of each config's trainer (fresh, seed 0), the trainers
    taking turns for `rounds` rounds on the same batch (the first config's first batch)."""
    trainers, batches = {}, {}
    for name, cfg in configs.items():
        torch.manual_seed(0)
        trainers[name] = DrafterTrainer(build_drafter(cfg, TargetHead.of(target)), cfg)
        layer_ids = resolve_layer_ids(cfg, target.config.num_hidden_layers)
        ids = capture_layer_ids(layer_ids, target.config.num_hidden_layers, cfg.loss.mix)
        examples = training_examples(cfg.data, target.config.vocab_size)[: cfg.data.batch_size]
        batches[name] = step_features(target, list(examples), ids, None, torch.device("cpu"))
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(rounds + 1):  # the first round warms up
        for name, trainer in trainers.items():
            started = time.perf_counter()
            trainer.train_step(**batches[name])
            times[name].append(time.perf_counter() - started)
    return {name: round(1000 * sorted(t[1:])[len(t[1:]) // 2], 2) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.drafter_kinds",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=str(REPO / ".cache" / "bench-drafter-kinds"),
                        help="where the demo assets and the runs go (the assets are reused)")
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps of each run (default 1000)")
    parser.add_argument("--preset", default="default", choices=sorted(PRESETS), help="the demo's size")
    parser.add_argument("--markov-rank", type=int, default=32, help="the DSpark head's rank (default 32)")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved steps timed per drafter (30)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(prepare(out / f"demo-{args.preset}", PRESETS[args.preset]).read_text())
    base["pipeline"]["threads_per_worker"] = 1
    eval_path = base["data"]["eval_path"]
    results = []
    target = prompts = None
    configs = {}
    for name, sections in kinds(args.markov_rank).items():
        path, train_s = train(base, name, sections, args.steps, out)
        cfg = configs[name] = load_config(path)
        if target is None:
            target = load_target(cfg.model.target_path, cfg.model.dtype)
            prompts = eval_prompts(heldout_path(cfg, eval_path), cfg.data.max_length, None)
        drafter = build_drafter(cfg, TargetHead.of(target))
        drafter.load_trainable_state_dict(load_checkpoint(latest_checkpoint(cfg.run.output_dir))[0])
        layer_ids = resolve_layer_ids(cfg, target.config.num_hidden_layers)
        # speculative_decode's block_size: the drafts per step plus one (DSpark drafts b, DFlash b - 1).
        propose, verify_block = kind_proposer(drafter)
        stats = decode(target, propose, prompts, layer_ids, verify_block, name)
        results.append({"drafter": name, "steps": args.steps, "tau": round(stats.tau, 3),
                        "drafts_per_step": verify_block - 1, "verify_steps": stats.verify_steps,
                        "acceptance_by_position": [round(r, 2) for r in stats.acceptance_by_position()],
                        "train_s": round(train_s, 1), "ms_per_step": round(1000 * train_s / args.steps, 1)})
    interleaved = interleaved_step_ms(configs, target, args.rounds)
    for r in results:
        r["interleaved_ms_per_step"] = interleaved[r["drafter"]]
    block_size = base["model"]["block_size"]
    layer_ids = resolve_layer_ids(load_config(out / "config-dflash-ce.yaml"), target.config.num_hidden_layers)
    lookup = decode(target, prompt_lookup_proposer(block_size), prompts, layer_ids, block_size,
                    "prompt lookup")
    print(f"the demo ({args.preset}) after {args.steps} steps each, {len(prompts)} held-out prompts, "
          f"{MAX_NEW_TOKENS} new tokens each, greedy, block size {block_size}")
    print(f"{'drafter':<17} {'tau':>6} {'drafts':>6} {'verify steps':>13} {'ms/step':>8} "
          f"{'interleaved':>11}  acceptance at draft position 1..")
    for r in results:
        print(f"{r['drafter']:<17} {r['tau']:>6.2f} {r['drafts_per_step']:>6} {r['verify_steps']:>13} "
              f"{r['ms_per_step']:>8.1f} {r['interleaved_ms_per_step']:>11.1f}  "
              + " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]))
    print(f"{'prompt lookup':<17} {lookup.tau:>6.2f} {block_size - 1:>6} {lookup.verify_steps:>13} {'-':>8} "
          f"{'-':>11}  " + " ".join(f"{a:.2f}" for a in lookup.acceptance_by_position()))
    ce = results[0]
    print("tau over dflash-ce: "
          + ", ".join(f"{r['drafter']} {r['tau'] / ce['tau']:.3f}x" for r in results[1:])
          + "; cost per step over dflash-ce: "
          + ", ".join(f"{r['drafter']} {r['interleaved_ms_per_step'] / ce['interleaved_ms_per_step']:.2f}x"
                      for r in results[1:]) + " (interleaved)")
    print(json.dumps({"benchmark": "drafter_kinds", "preset": args.preset, "steps": args.steps,
                      "runs": results, "prompt_lookup_tau": round(lookup.tau, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
