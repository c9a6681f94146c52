"""Feature cache: drafter tokens/s from the cache against the online target, its bytes on disk
against the floor, and the capture's rate against the target stage alone.

Measured in one run, on the machine at hand, with the pipeline benchmark's random-init target and
fixed-length synthetic data (`benchmarks.pipeline.build_assets`; every step trains on batch_size x
seq_len real tokens), the same batches everywhere:

- stages, in this process (one thread), on the same batches, the paths taking each batch in turn
  (so that all see the same machine), `--repeats` times, best of each: the target alone
  (`target_hidden_states`); the online step (the target, then a drafter's step on its features);
  a drafter's step on features held in memory (the drafter stage alone); a drafter's step on
  features read from the cache through its feed (`CacheFeed`, reading ahead on a thread). The
  three drafters' losses are checked equal;
- the capture (`dflash_ops.capture.capture` into a fresh directory), each followed by the target
  alone on the capture's batches, `--repeats` times in turn: tokens/s over the time its replica
  spent on shards (target forward, packing, writing and hashing; the target's load left out);
- training runs, `python -m dflash_ops.train`, interleaved, fastest of each: in one process, online
  (the target and the drafter take turns) and from the cache (no target); as a pipeline, online
  (1 target worker feeding 1 drafter worker) and from the cache (1 drafter worker, no target);
  steady-state rates from their step events (`benchmarks.pipeline.steady_rate`);
- bytes per token on disk: the capture's shards over its tokens, and one shard written at
  Qwen3-8B's shape (k = 5 layers of H = 4096, bfloat16: synthetic features of `--qwen-tokens`
  tokens), each against the floor k * H * dtype bytes; and what a default-size shard (512 MiB)
  costs per million tokens at that shape.

Target: the drafter stage from the cache >= 0.9x its stand-alone rate on features in memory.
Prints a table, then one JSON line.

    python -m benchmarks.feature_cache                 # default sizes, about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from benchmarks.pipeline import build_assets, run_training
from dflash_ops.core.config import load_config
from dflash_ops.core.runtime import StopSignal
from dflash_ops.data.capture import DEFAULT_SHARD_MB, capture, capture_batches, write_shard
from dflash_ops.data.examples import BatchOrder, Example, collate, load_examples
from dflash_ops.data.feature_cache import shard_bytes
from dflash_ops.data.target import TargetHead, load_target, target_hidden_states
from dflash_ops.run.cache_feed import CacheFeed, FeatureCache
from dflash_ops.training.trainer import DrafterTrainer, build_drafter, resolve_layer_ids

QWEN3_8B = {"k": 5, "hidden": 4096, "dtype": "bfloat16", "bytes": 2}


class QuietLog:
    def __init__(self):
        self.events: list[dict] = []

    def emit(self, event: str, **fields) -> None:
        self.events.append({"event": event, **fields})


def stages_in_turn(cfg, target, layer_ids, padded: list, cached) -> dict[str, float]:
    """Seconds of each path over the batches `padded`, the paths taking each batch in turn so that
    all see the same machine (the first batch is a warm-up, not timed): the target alone; the online
    step (the target, then a drafter's step on its features); a second drafter's step on the target
    alone's features, held in memory; a third's on those the iterator `cached` reads from the cache.
    The three drafters start equal and must give equal losses."""
    trainers = {}
    for path in ("online", "memory", "cache"):
        torch.manual_seed(cfg.run.seed)
        trainers[path] = DrafterTrainer(build_drafter(cfg, TargetHead.of(target)), cfg)
    seconds = dict.fromkeys(("target", *trainers), 0.0)
    losses: dict[str, list[float]] = {path: [] for path in trainers}

    def online_inputs(batch):
        k = target_hidden_states(target, batch["input_ids"], batch["attention_mask"], layer_ids)
        return (k.features, k.cu_seqlens, k.position_ids, k.pack(batch["input_ids"]),
                k.pack(batch["loss_mask"]))

    for step, batch in enumerate(padded):
        started = time.perf_counter()
        in_memory = online_inputs(batch)
        seconds["target"] += (time.perf_counter() - started) if step else 0.0
        for path in trainers:
            started = time.perf_counter()
            if path == "online":
                inputs = online_inputs(batch)
            else:
                inputs = in_memory if path == "memory" else next(cached)
            losses[path].append(trainers[path].train_step(*inputs).loss)
            seconds[path] += (time.perf_counter() - started) if step else 0.0
    if not losses["online"] == losses["memory"] == losses["cache"]:
        raise SystemExit("the drafter's losses from the cache differ from those on the online features")
    return seconds


def from_cache(cache: FeatureCache, cfg, n_batches: int):
    """Step inputs read by the cache's feed (a thread reading `queue_depth` batches ahead)."""
    feed = CacheFeed(cache, BatchOrder(len(cache), cfg.data.batch_size, cfg.run.seed), 0, n_batches, 0, 1,
                     cfg.pipeline.queue_depth)
    while isinstance(batch := feed.next(StopSignal()), dict):
        yield tuple(batch[k] for k in ("features", "cu_seqlens", "position_ids", "input_ids", "loss_mask"))


def stage_rates(config_path: Path, cache_dir: Path, n_batches: int, repeats: int) -> dict:
    """Stand-alone tokens/s of the target, the drafter on features in memory and the drafter from
    the cache, on the same batches (one warm-up batch, then `n_batches` timed), best of `repeats`."""
    torch.set_num_threads(1)
    cfg = load_config(config_path)
    target = load_target(cfg.model.target_path)
    layer_ids = resolve_layer_ids(cfg, target.config.num_hidden_layers)
    examples = load_examples(cfg.data.path, cfg.data.max_length)
    order = BatchOrder(len(examples), cfg.data.batch_size, cfg.run.seed)
    padded = [collate([examples[i] for i in order.next_batch()]) for _ in range(n_batches + 1)]
    cache = FeatureCache(cache_dir)
    tokens = sum(int(p["attention_mask"].sum()) for p in padded[1:])  # the timed steps'
    best = dict.fromkeys(("target", "online", "memory", "cache"), float("inf"))
    for _ in range(repeats):
        seconds = stages_in_turn(cfg, target, layer_ids, padded, from_cache(cache, cfg, n_batches + 1))
        best = {path: min(best[path], seconds[path]) for path in best}
    return {name: tokens / seconds for name, seconds in best.items()}


def capture_rates(cfg, work: Path, repeats: int) -> tuple[float, float, int, int]:
    """(capture tokens/s, target stage tokens/s, tokens, bytes on disk): captures into fresh
    directories, each followed by the target alone on the capture's batches, `repeats` times in
    turn, best of each. The capture's time is its replica's on the shards (target, packing, writing)."""
    examples = load_examples(cfg.data.path, cfg.data.max_length)
    target = load_target(cfg.model.target_path)
    layer_ids = resolve_layer_ids(cfg, target.config.num_hidden_layers)
    order = capture_batches(len(examples), cfg.data.batch_size, cfg.run.seed)
    batches = [collate([examples[i] for i in batch]) for batch in order]
    best_capture = best_target = float("inf")
    for attempt in range(repeats):
        log = QuietLog()
        summary = capture(cfg, work / f"cache-{attempt}", log=log)
        best_capture = min(best_capture, sum(e["seconds"] for e in log.events if e["event"] == "shard"))
        started = time.perf_counter()
        for batch in batches:
            target_hidden_states(target, batch["input_ids"], batch["attention_mask"], layer_ids)
        best_target = min(best_target, time.perf_counter() - started)
    disk = sum(p.stat().st_size for p in (work / "cache-0").glob("shard-*"))
    return summary["tokens"] / best_capture, summary["tokens"] / best_target, summary["tokens"], disk


def qwen_shard(work: Path, n_tokens: int) -> tuple[int, int]:
    """(bytes on disk, tokens) of one shard written at Qwen3-8B's feature shape, 4 documents."""
    width = QWEN3_8B["k"] * QWEN3_8B["hidden"]
    lengths = [n_tokens // 4] * 3 + [n_tokens - 3 * (n_tokens // 4)]
    examples = [Example(torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.int64)) for n in lengths]
    plan = {"width": width, "dtype": QWEN3_8B["dtype"]}
    shard = {"name": "shard-00000.safetensors", "batches": [0, 1], "documents": 4, "tokens": n_tokens,
             "bytes": shard_bytes(n_tokens, 4, width, QWEN3_8B["dtype"])}
    generator = torch.Generator().manual_seed(0)

    def features_of(batch):
        return torch.randn(n_tokens, width, generator=generator).to(torch.bfloat16)

    write_shard(work, shard, plan, [[0, 1, 2, 3]], examples, features_of)
    return (work / shard["name"]).stat().st_size, n_tokens


def from_cache_config(work: Path, online_config: Path, name: str, pipeline: dict) -> Path:
    """The online config's run reading the cache in work/cache, with `pipeline` on top."""
    raw = yaml.safe_load(online_config.read_text())
    raw["data"]["features_path"] = str(work / "cache")
    raw["run"]["output_dir"] = str(work / f"run-{name}")
    raw["pipeline"].update(pipeline)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.feature_cache",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per training run (30)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the steady-state rate (5)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step (8)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (128)")
    parser.add_argument("--hidden", type=int, default=128, help="target hidden size (128)")
    parser.add_argument("--target-layers", type=int, default=6, help="target depth (6)")
    parser.add_argument("--max-anchors", type=int, default=4, help="anchors per sequence (4)")
    parser.add_argument("--block-size", type=int, default=8, help="drafter block size (8)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size (1024)")
    parser.add_argument("--queue-depth", type=int, default=4, help="batches the cache feed reads ahead (4)")
    parser.add_argument("--stage-batches", type=int, default=12, help="batches timed per stage (12)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved repeats; the best counts (2)")
    parser.add_argument("--qwen-tokens", type=int, default=2048,
                        help="tokens of the shard written at Qwen3-8B's shape (2048: 84 MB)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="dflash-bench-cache-") as tmp:
        work = Path(tmp)
        online_config = build_assets(work, args)
        cfg = load_config(online_config)
        capture_rate, capture_target_rate, captured_tokens, disk = capture_rates(cfg, work, args.repeats)
        (work / "cache-0").rename(work / "cache")
        rates = stage_rates(online_config, work / "cache", args.stage_batches, args.repeats)
        configs = {"online": online_config, "online_pipeline": work / "pipeline.yaml",
                   "cache": from_cache_config(work, online_config, "cache", {}),
                   "cache_pipeline": from_cache_config(work, online_config, "cache-pipeline",
                                                       {"target_workers": 0, "drafter_workers": 1})}
        tokens_per_step = args.batch_size * args.seq_len
        runs: dict[str, list[dict]] = {name: [] for name in configs}
        for _ in range(args.repeats):  # interleaved, so that all face the same machine; the fastest counts
            for name, config in configs.items():
                runs[name].append(run_training(config, tokens_per_step, args.warmup))
        best = {name: max(runs[name], key=lambda r: r["tokens_per_s"])["tokens_per_s"] for name in runs}
        qwen_dir = work / "qwen"
        qwen_dir.mkdir()
        qwen_bytes, qwen_tokens = qwen_shard(qwen_dir, args.qwen_tokens)

    width = args.hidden  # one draft layer: k = 1
    floor = width * 4  # float32
    qwen_floor = QWEN3_8B["k"] * QWEN3_8B["hidden"] * QWEN3_8B["bytes"]
    # A default-size shard at Qwen3-8B's shape: documents of 3072 tokens.
    default_tokens = (DEFAULT_SHARD_MB << 20) // qwen_floor
    default_shard = shard_bytes(default_tokens, max(1, default_tokens // 3072),
                                QWEN3_8B["k"] * QWEN3_8B["hidden"], QWEN3_8B["dtype"])
    default_per_token = default_shard / default_tokens
    figures = {
        "benchmark": "feature_cache", "cpus": os.cpu_count(), "load_average_1m": round(os.getloadavg()[0], 2),
        "sizes": {k: getattr(args, k) for k in ("steps", "batch_size", "seq_len", "hidden", "target_layers",
                                                "max_anchors", "stage_batches", "repeats", "qwen_tokens")},
        "target_stage_tokens_per_s": round(rates["target"], 1),
        "drafter_stage_memory_tokens_per_s": round(rates["memory"], 1),
        "drafter_stage_cache_tokens_per_s": round(rates["cache"], 1),
        "drafter_cache_vs_memory": round(rates["cache"] / rates["memory"], 3),
        "online_step_tokens_per_s": round(rates["online"], 1),
        "drafter_cache_vs_online_step": round(rates["cache"] / rates["online"], 3),
        "capture_tokens_per_s": round(capture_rate, 1),
        "capture_target_stage_tokens_per_s": round(capture_target_rate, 1),
        "capture_vs_target_stage": round(capture_rate / capture_target_rate, 3),
        **{f"{name}_run_tokens_per_s": round(rate, 1) for name, rate in best.items()},
        "cache_run_vs_online_run": round(best["cache"] / best["online"], 3),
        "cache_pipeline_vs_online_pipeline": round(best["cache_pipeline"] / best["online_pipeline"], 3),
        "cache_run_vs_drafter_stage": round(best["cache"] / rates["memory"], 3),
        "cache_pipeline_vs_drafter_stage": round(best["cache_pipeline"] / rates["memory"], 3),
        "bench_bytes_per_token": round(disk / captured_tokens, 2), "bench_floor_bytes_per_token": floor,
        "qwen3_8b_bytes_per_token": round(qwen_bytes / qwen_tokens, 2),
        "qwen3_8b_floor_bytes_per_token": qwen_floor,
        "qwen3_8b_default_shard_bytes_per_token": round(default_per_token, 3),
        "qwen3_8b_gb_per_million_tokens": round(default_per_token * 1e6 / 1e9, 3),
    }
    figures["meets_targets"] = {"drafter_cache_vs_memory>=0.9": figures["drafter_cache_vs_memory"] >= 0.9}
    rows = [
        ("target stage alone", rates["target"], ""),
        ("drafter stage, features in memory", rates["memory"], ""),
        ("drafter stage, features from the cache", rates["cache"],
         f"{figures['drafter_cache_vs_memory']:.3f}x memory, "
         f"{figures['drafter_cache_vs_online_step']:.2f}x online step"),
        ("online step (target, then drafter)", rates["online"], ""),
        ("target stage alone, the capture's batches", capture_target_rate, ""),
        ("capture (target + packing + writing)", capture_rate,
         f"{figures['capture_vs_target_stage']:.3f}x target"),
        ("run, one process, online (target + drafter)", best["online"], ""),
        ("run, one process, from the cache", best["cache"],
         f"{figures['cache_run_vs_online_run']:.2f}x online, "
         f"{figures['cache_run_vs_drafter_stage']:.2f}x drafter"),
        ("run, pipeline, online (1 target + 1 drafter)", best["online_pipeline"], ""),
        ("run, pipeline, from the cache (1 drafter)", best["cache_pipeline"],
         f"{figures['cache_pipeline_vs_online_pipeline']:.2f}x online, "
         f"{figures['cache_pipeline_vs_drafter_stage']:.2f}x drafter"),
    ]
    print(f"{'configuration':<46} {'tokens/s':>10}  ratio")
    print("-" * 90)
    for name, rate, note in rows:
        print(f"{name:<46} {rate:>10.0f}  {note}")
    print(f"bytes/token on disk: {figures['bench_bytes_per_token']} here (floor {floor}); "
          f"{figures['qwen3_8b_bytes_per_token']} at Qwen3-8B's shape for a {qwen_tokens}-token shard, "
          f"{figures['qwen3_8b_default_shard_bytes_per_token']} for a {DEFAULT_SHARD_MB} MiB one "
          f"(floor {qwen_floor}): {figures['qwen3_8b_gb_per_million_tokens']} GB per million tokens")
    print(f"{os.cpu_count()} CPUs, load average {figures['load_average_1m']} at the end")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
