"""A checkpoint's cost to the step: written synchronously vs copied to host and written on a thread.

The state is the recipe's drafter scaled down by `--scale` (Qwen3-8B's paper drafter: 1.05 B trainable
parameters; fp32 weights and AdamW's two fp32 moments, 12 bytes a parameter: 12.6 GB), in tensors of
the draft layers' shapes divided by the scale. Each save, both ways, into a fresh output dir on `--dir`'s
disk, with the product's own code:

- sync: `save_checkpoint` (dflash_ops.training.checkpoint) on the step's thread, as before: the step is
  blocked for the whole write (temp dir, safetensors + torch.save, fsyncs, rename);
- async: `CheckpointWriter.snapshot` then `start` (dflash_ops.training.checkpoint_writer), as the run
  does now: the step is blocked for the host copy only; the write then runs on its thread.

Also timed: a stand-in step (CPU matmuls, `--step-threads` threads) while the write runs on its thread
and while nothing does, the cost the write still has for the steps it overlaps on this machine (GIL,
memory bandwidth, the disk). At the recipe, on a GPU, the copy is device to pinned host memory: its
bandwidth is not measured here (no GPU) but taken as `--d2h-gbps` (PCIe Gen5 x16, a conservative
fraction of its 64 GB/s); the write's time is this disk's measured rate at 12.6 GB. Both said as
modelled.

    python -m benchmarks.checkpoint_write                 # scale 64: ~197 MB a checkpoint
    python -m benchmarks.checkpoint_write --scale 16 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dflash_ops.training.checkpoint import save_checkpoint
from dflash_ops.training.checkpoint_writer import CheckpointWriter

RECIPE_PARAMS = 1.05e9  # docs/SCALE.md: the paper's drafter at Qwen3-8B's width, fc included
BYTES_PER_PARAM = 12  # fp32 weights + AdamW's exp_avg and exp_avg_sq
HIDDEN, INTER, LAYERS, K = 4096, 12288, 5, 5  # Qwen3-8B's width, the drafter's layers, target features


def recipe_shapes(scale: int) -> dict[str, tuple[int, int]]:
    """The trainable weights' shapes, each with 1/scale of its rows."""
    shapes = {"fc.weight": (HIDDEN // scale, K * HIDDEN)}
    layer = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (1024, HIDDEN), "v_proj": (1024, HIDDEN),
             "o_proj": (HIDDEN, HIDDEN), "gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN),
             "down_proj": (HIDDEN, INTER)}
    for i in range(LAYERS):
        for name, (rows, cols) in layer.items():
            shapes[f"layers.{i}.{name}.weight"] = (max(1, rows // scale), cols)
    return shapes


def make_state(scale: int) -> tuple[dict, dict]:
    weights = {name: torch.randn(shape) for name, shape in recipe_shapes(scale).items()}
    optimizer = {"state": {i: {"step": torch.tensor(100.0), "exp_avg": torch.randn_like(w),
                               "exp_avg_sq": torch.rand_like(w)} for i, w in enumerate(weights.values())},
                 "param_groups": [{"lr": 6e-4, "betas": (0.9, 0.95), "params": list(range(len(weights)))}]}
    return weights, {"trainer": {"step": 100, "optimizer": optimizer, "scheduler": {}}, "data": {}, "rng": []}


def stand_in_steps(n: int, size: int = 512) -> float:
    """Seconds for `n` steps of matmuls (a CPU step's compute, no Python in the loop)."""
    a = torch.randn(size, size)
    started = time.perf_counter()
    for _ in range(n):
        a = torch.tanh(a @ a)
    return time.perf_counter() - started


def save_sync(root: Path, step: int, weights, state) -> dict:
    started = time.perf_counter()
    save_checkpoint(root, step, weights, state, "x: 1\n", {}, keep=1)
    blocked = time.perf_counter() - started
    return {"blocked_s": blocked, "write_s": blocked}


def save_async(root: Path, step: int, weights, state, writer: CheckpointWriter, steps: int) -> dict:
    started = time.perf_counter()
    copied_weights, copied_state = writer.snapshot((weights, state))
    writer.start(step, lambda: save_checkpoint(root, step, copied_weights, copied_state, "x: 1\n", {}, 1))
    blocked = time.perf_counter() - started
    steps_during = stand_in_steps(steps)  # the steps that train on meanwhile
    overlapped = not writer.done()
    writer.wait()
    return {"blocked_s": blocked, "write_s": time.perf_counter() - started, "steps_during_s": steps_during,
            "write_outlasted_steps": overlapped}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint_write",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=64, help="rows of each weight divided by this")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: .cache/)")
    parser.add_argument("--steps", type=int, default=20, help="stand-in steps run while the write runs")
    parser.add_argument("--step-threads", type=int, default=1)
    parser.add_argument("--d2h-gbps", type=float, default=20.0,
                        help="device to pinned host copy rate at the recipe (modelled, GB/s)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.step_threads)
    base = Path(args.dir) if args.dir else Path(__file__).resolve().parents[1] / ".cache"
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="checkpoint-write-", dir=base))
    try:
        weights, state = make_state(args.scale)
        nbytes = sum(w.numel() for w in weights.values()) * BYTES_PER_PARAM
        writer = CheckpointWriter()
        rows = {"sync": [], "async": []}
        idle = []
        for i in range(args.repeats):  # alternating, in one run
            rows["sync"].append(save_sync(work / f"sync-{i}", 1, weights, state))
            rows["async"].append(save_async(work / f"async-{i}", 1, weights, state, writer, args.steps))
            idle.append(stand_in_steps(args.steps))
        med = {mode: {key: statistics.median(r[key] for r in runs) for key in ("blocked_s", "write_s")}
               for mode, runs in rows.items()}
        steps_during = statistics.median(r["steps_during_s"] for r in rows["async"])
        steps_idle = statistics.median(idle)
        write_gbps = nbytes / med["sync"]["write_s"] / 1e9
        copy_gbps = nbytes / med["async"]["blocked_s"] / 1e9
        recipe = RECIPE_PARAMS * BYTES_PER_PARAM
        model = {"sync_blocked_s": recipe / 1e9 / write_gbps, "async_blocked_s": recipe / 1e9 / args.d2h_gbps}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    sync, asyn = med["sync"], med["async"]
    print(f"checkpoint of {nbytes / 1e6:.0f} MB (the recipe's 12.6 GB / {args.scale}), {args.repeats} saves "
          f"each way, medians; disk of {base}; {os.cpu_count()} CPUs")
    print(f"{'':<34} {'sync':>10} {'async':>10} {'async/sync':>11}")
    for label, key in (("step blocked, s", "blocked_s"), ("save to checkpoint on disk, s", "write_s")):
        print(f"{label:<34} {sync[key]:>10.3f} {asyn[key]:>10.3f} {asyn[key] / sync[key]:>10.3f}x")
    print(f"stand-in steps ({args.steps}) while the write runs {steps_during:.3f} s, with nothing else "
          f"{steps_idle:.3f} s: {steps_during / steps_idle:.2f}x")
    print(f"measured: disk write {write_gbps:.2f} GB/s, host copy {copy_gbps:.2f} GB/s (the first save's "
          f"copy, which allocates the host buffers: {rows['async'][0]['blocked_s']:.3f} s)")
    print(f"modelled at the recipe (12.6 GB): sync blocks the step {model['sync_blocked_s']:.1f} s (this "
          f"disk's rate), async {model['async_blocked_s']:.2f} s (device to pinned host at {args.d2h_gbps:g} "
          f"GB/s, assumed): {model['async_blocked_s'] / model['sync_blocked_s']:.3f}x; the write goes on "
          "under the steps, and the next save waits for it only if it comes sooner")
    print(json.dumps({"benchmark": "checkpoint_write", "scale": args.scale, "bytes": nbytes,
                      "repeats": args.repeats, "sync": sync, "async": asyn,
                      "blocked_ratio": asyn["blocked_s"] / sync["blocked_s"],
                      "first_async_blocked_s": rows["async"][0]["blocked_s"],
                      "steps_during_write_s": steps_during, "steps_idle_s": steps_idle,
                      "disk_write_gbps": write_gbps, "host_copy_gbps": copy_gbps,
                      "recipe_modelled": {**model, "d2h_gbps_assumed": args.d2h_gbps},
                      "cpus": os.cpu_count()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
