"""Pipeline overlap: drafter training tokens/s, target and drafter in one process versus separate workers.

Measured in one run, on CPU, with a tiny random target and synthetic data of fixed-length rows
(so every step trains on batch_size x seq_len real tokens):

- stage rates, stand-alone in this process (one thread): the target's forward with the packed
  hidden states (`target_hidden_states`), and the drafter's optimizer step on features computed
  ahead (`DrafterTrainer.train_step`);
- (a) sequential: `python -m dflash_ops.train` with no workers, target then drafter in one process;
- (b) pipeline: `python -m dflash_ops.train` with one target worker and one drafter worker (one thread
  each), batches flowing through the bounded queue.

(a) and (b) run `--repeats` times each, interleaved; the fastest run of each counts (on a shared
machine the fastest is the least disturbed).

The rates of (a) and (b) are steady-state: real tokens of the steps after the first `--warmup`
divided by the time between their step events, so process start-up and the final checkpoint are
left out. Targets (issue 7): (b) >= 0.8x the slower stage's stand-alone rate, and >= 1.4x (a)
when the two stages cost about the same (the table shows their cost ratio). On a shared machine
the pipeline's two workers need two free cores.

Prints a table, then, as its last line, one JSON object with every figure.

    python -m benchmarks.pipeline                    # default sizes, under 2 minutes on 2 cores
    python -m benchmarks.pipeline --steps 80 --target-layers 8 --max-anchors 8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from dflash_ops.core.config import load_config
from dflash_ops.data.examples import BatchOrder, collate, load_examples
from dflash_ops.data.target import TargetHead, load_target, target_hidden_states
from dflash_ops.training.trainer import DrafterTrainer, build_drafter, resolve_layer_ids

REPO = Path(__file__).resolve().parents[1]
SIZE_OPTIONS = ("steps", "warmup", "batch_size", "seq_len", "hidden", "target_layers", "max_anchors",
                "block_size", "queue_depth", "repeats")


def build_assets(work: Path, args: argparse.Namespace) -> Path:
    """A random-init Qwen3 target, fixed-length synthetic data, and the single-process config."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    torch.manual_seed(0)
    heads = max(1, args.hidden // 32)
    target = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.target_layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=args.hidden // heads, max_position_embeddings=max(512, args.seq_len),
    ))
    target.save_pretrained(work / "target")
    rng = random.Random(0)
    prompt_len = args.seq_len // 2
    with (work / "train.jsonl").open("w") as out:
        for _ in range(4 * args.batch_size):
            ids = [rng.randrange(args.vocab - 1) for _ in range(args.seq_len)]
            loss_mask = [0] * prompt_len + [1] * (args.seq_len - prompt_len)
            out.write(json.dumps({"input_ids": ids, "loss_mask": loss_mask}) + "\n")
    config = {
        "model": {"target_path": str(work / "target"), "num_draft_layers": 1, "block_size": args.block_size},
        "data": {"path": str(work / "train.jsonl"), "max_length": args.seq_len, "batch_size": args.batch_size,
                 "max_anchors": args.max_anchors},
        "optim": {"total_steps": args.steps, "lr": 1e-3},
        "run": {"output_dir": str(work / "run-sequential"), "save_every": 10 * args.steps, "log_every": 1,
                "resume": False},
        "pipeline": {"device": "cpu", "threads_per_worker": 1, "queue_depth": args.queue_depth},
    }
    path = work / "sequential.yaml"
    path.write_text(yaml.safe_dump(config))
    config["run"]["output_dir"] = str(work / "run-pipeline")
    config["pipeline"].update(target_workers=1, drafter_workers=1)
    (work / "pipeline.yaml").write_text(yaml.safe_dump(config))
    return path


def stage_rates(config_path: Path, repeats: int) -> tuple[float, float]:
    """Stand-alone tokens/s of the target stage and of the drafter stage, one thread, this process."""
    torch.set_num_threads(1)
    cfg = load_config(config_path)
    torch.manual_seed(cfg.run.seed)
    target = load_target(cfg.model.target_path)
    layer_ids = resolve_layer_ids(cfg, target.config.num_hidden_layers)
    examples = load_examples(cfg.data.path, cfg.data.max_length)
    order = BatchOrder(len(examples), cfg.data.batch_size, cfg.run.seed)
    batches = [collate([examples[i] for i in order.next_batch()]) for _ in range(repeats)]

    def target_stage(batch):
        return target_hidden_states(target, batch["input_ids"], batch["attention_mask"], layer_ids)

    target_stage(batches[0])  # warm-up
    started = time.perf_counter()
    packed = [target_stage(batch) for batch in batches]
    target_s = time.perf_counter() - started

    trainer = DrafterTrainer(build_drafter(cfg, TargetHead.of(target)), cfg)
    inputs = [(p.features, p.cu_seqlens, p.position_ids, p.pack(b["input_ids"]), p.pack(b["loss_mask"]))
              for p, b in zip(packed, batches, strict=True)]
    trainer.train_step(*inputs[0])  # warm-up
    started = time.perf_counter()
    for step_inputs in inputs:
        trainer.train_step(*step_inputs)
    drafter_s = time.perf_counter() - started
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    return tokens / target_s, tokens / drafter_s


def run_training(config_path: Path, tokens_per_step: int, warmup: int) -> dict:
    """Run `python -m dflash_ops.train`; steady-state tokens/s from its step events."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "dflash_ops.train", "--config", str(config_path)],
                            cwd=REPO, capture_output=True, text=True, start_new_session=True)
    wall = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"training run {config_path.name} failed ({result.returncode}):\n"
                         f"{result.stderr[-3000:]}")
    return {**steady_rate(config_path.name, result.stdout, tokens_per_step, warmup), "wall_s": wall}


def steady_rate(name: str, stdout: str, tokens_per_step: int, warmup: int) -> dict:
    """Steady-state tokens/s from a run's step events: the steps after the first `warmup`."""
    steps = [json.loads(line) for line in stdout.splitlines()
             if line.startswith("{") and '"event": "step"' in line]
    steady = steps[warmup:]
    if len(steady) < 2:
        raise SystemExit(f"{name}: too few steps after the warm-up ({len(steps)} in all)")
    seconds = steady[-1]["time"] - steady[0]["time"]
    rate = (len(steady) - 1) * tokens_per_step / seconds
    return {"tokens_per_s": rate, "steps": len(steps), "final_loss": steps[-1]["loss"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per training run (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the steady-state rate (5)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (8)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (128)")
    parser.add_argument("--hidden", type=int, default=128, help="target hidden size (128)")
    parser.add_argument("--target-layers", type=int, default=6,
                        help="target depth: the target stage's cost (6)")
    parser.add_argument("--max-anchors", type=int, default=4,
                        help="anchors per sequence: the drafter stage's cost (4)")
    parser.add_argument("--block-size", type=int, default=8, help="drafter block size (8)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size (1024)")
    parser.add_argument("--queue-depth", type=int, default=4, help="batches in flight in the pipeline (4)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of (a) and of (b), interleaved; the fastest of each counts (2)")
    parser.add_argument("--stage-repeats", type=int, default=10,
                        help="batches timed per stand-alone stage (10)")
    args = parser.parse_args(argv)
    sizes = (args.steps - args.warmup, args.batch_size, args.seq_len, args.target_layers, args.stage_repeats)
    if min(sizes) < 2 or args.repeats < 1:
        parser.error("--steps must exceed --warmup by 2 or more; sizes and --stage-repeats must be >= 2, "
                     "--repeats >= 1")

    with tempfile.TemporaryDirectory(prefix="dflash-bench-pipeline-") as tmp:
        work = Path(tmp)
        sequential_config = build_assets(work, args)
        target_rate, drafter_rate = stage_rates(sequential_config, args.stage_repeats)
        tokens_per_step = args.batch_size * args.seq_len
        runs: dict[str, list[dict]] = {"sequential": [], "pipeline": []}
        for _ in range(args.repeats):  # interleaved, so both face the same machine; the best counts
            runs["sequential"].append(run_training(sequential_config, tokens_per_step, args.warmup))
            runs["pipeline"].append(run_training(work / "pipeline.yaml", tokens_per_step, args.warmup))
        sequential, pipeline = (max(runs[name], key=lambda r: r["tokens_per_s"]) for name in runs)

    slower = min(target_rate, drafter_rate)
    figures = {
        "benchmark": "pipeline",
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),  # other work on the machine skews every rate
        "sizes": {k: getattr(args, k) for k in SIZE_OPTIONS},
        "target_stage_tokens_per_s": round(target_rate, 1),
        "drafter_stage_tokens_per_s": round(drafter_rate, 1),
        "stage_cost_ratio": round(max(target_rate, drafter_rate) / slower, 3),
        "sequential_tokens_per_s": round(sequential["tokens_per_s"], 1),
        "pipeline_tokens_per_s": round(pipeline["tokens_per_s"], 1),
        "pipeline_vs_slower_stage": round(pipeline["tokens_per_s"] / slower, 3),
        "pipeline_vs_sequential": round(pipeline["tokens_per_s"] / sequential["tokens_per_s"], 3),
        "sequential_wall_s": round(sequential["wall_s"], 1),
        "pipeline_wall_s": round(pipeline["wall_s"], 1),
    }
    figures["meets_targets"] = {
        "pipeline_vs_slower_stage>=0.8": figures["pipeline_vs_slower_stage"] >= 0.8,
        "pipeline_vs_sequential>=1.4": figures["pipeline_vs_sequential"] >= 1.4,
    }
    rows = [
        ("target stage alone", target_rate, ""),
        ("drafter stage alone", drafter_rate, ""),
        ("(a) sequential, one process", sequential["tokens_per_s"], ""),
        ("(b) pipeline, 1 target + 1 drafter", pipeline["tokens_per_s"],
         f"{figures['pipeline_vs_slower_stage']:.2f}x slower stage, "
         f"{figures['pipeline_vs_sequential']:.2f}x (a)"),
    ]
    print(f"{'configuration':<36} {'tokens/s':>10}  ratio")
    print("-" * 80)
    for name, rate, note in rows:
        print(f"{name:<36} {rate:>10.0f}  {note}")
    print(f"stage cost ratio (slower/faster): {figures['stage_cost_ratio']:.2f}; {os.cpu_count()} CPUs, "
          f"load average {figures['load_average_1m']} at the end")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
