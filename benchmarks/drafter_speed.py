"""The drafter rank's step at the recipe's shape on one GPU: FlexAttention against the tiles, in samples/s.

The trainer's own step (`DrafterTrainer.train_step`: layout, forward, chunked loss, backward, clipping,
AdamW) of `configs/qwen3-8b.yaml`'s drafter rank (Qwen3-8B's width, random weights, 5 layers, bf16
autocast over fp32 master weights, 512 anchors of 16 per 3072-token document, batch 8) on random
features, once per attention backend, each in a fresh process:

- `auto`: what a run on the device uses (on CUDA FlexAttention under torch.compile; where flex cannot
  train, the tiles, and the row says so);
- `tiles`: the block-sparse tiles of SDPA (the reference path).

Each runs its warm-up steps (`STEPS`; the first compiles), then measured steps whose document layouts
change (eight full documents, then ten of other lengths: other anchors, other groups), so that a shape
the compiled region has not seen would show as a new compilation. Per backend: the first step's seconds
(compilation included), the measured steps' median and samples/s (documents of 3072 tokens per
second, full-batch steps) and tokens/s (every real token), `max_memory_reserved` and
`max_memory_allocated` over the measured steps beside the memory model's prediction, and the graphs
torch.compile built during warm-up and after it (the goal: none after). Beside them, SpecForge's
published figure (one H200 trainer, online Qwen3-4B DFlash, 5 layers, 512 anchors, batch 4 of mean
1,295 tokens, FlexAttention compiled: 8.7 samples/s, 11,253 useful tokens/s;
docs/sections/benchmarks/online-sequence-packing.md of sgl-project/SpecForge) and its scaling to
Qwen3-8B's width (~4.5 samples/s: the drafter's FLOPs per token grow ~1.9x from H 2560 to 4096).

    python3 -m benchmarks.drafter_speed                 # one H200: about 3 minutes (the tiles: 2)
    python3 -m benchmarks.gpu_check --parts drafter_speed --out DIR   # the same, in the check's table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("auto", "tiles")
# (warm-up steps, measured steps) per backend: the tiles took ~50 s a step at this shape on an H200
# (BENCHMARKS.md), so they get one of each, and the part stays within a few minutes.
STEPS = {"auto": (2, 4), "tiles": (1, 1)}
SPECFORGE = {"samples_per_s": 8.7, "tokens_per_s": 11253, "width_scaled_samples_per_s": 4.5,
             "source": "SpecForge, one H200, online Qwen3-4B DFlash (5 layers, 512 anchors, batch 4, mean "
                       "1,295 tokens, FlexAttention compiled): docs/sections/benchmarks/"
                       "online-sequence-packing.md; ~4.5 samples/s scaled to Qwen3-8B's width"}


def layouts(max_length: int, batch_size: int, measured: int) -> list[list[int]]:
    """The measured steps' documents: the full batch, then as many tokens in documents of other lengths."""
    full = [max_length] * batch_size
    third = max_length // 3
    ragged = [max_length] * (batch_size - 2) + [third, max_length - third, max_length // 2,
                                                 max_length - max_length // 2]
    return [full if i % 2 == 0 else ragged for i in range(measured)]


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def measure(mode: str, device: str, backend: str) -> dict:
    """One backend's figures, in this process."""
    from benchmarks.gpu_check import (
        TARGET_SHAPE,
        predicted_peaks,
        recipe_batch,
        recipe_trainer,
        synced_seconds,
    )

    dev = torch.device(device)
    trainer, cfg, width, dtype = recipe_trainer(mode, dev, attention_backend=backend)
    d = cfg.data
    g = torch.Generator(device=dev).manual_seed(0)

    def step(lengths=None) -> tuple[float, object]:
        batch = recipe_batch(cfg, width, dtype, dev, g, lengths)
        seconds, result = synced_seconds(lambda: trainer.train_step(**batch), dev)
        print(f"{backend} ({trainer.attention.backend}): step {trainer.step} of {len(lengths or [])} or "
              f"{d.batch_size} documents in {seconds:.2f} s", file=sys.stderr, flush=True)
        return seconds, result

    warmup, measured_steps = STEPS[backend]
    first_seconds, _ = step()
    for _ in range(warmup - 1):
        step()
    graphs_at_warmup = compiled_graphs()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    measured = [(lengths, *step(lengths)) for lengths in layouts(d.max_length, d.batch_size, measured_steps)]
    full_steps = [seconds for lengths, seconds, _ in measured if lengths == [d.max_length] * d.batch_size]
    step_seconds = statistics.median(full_steps)
    tokens = sum(sum(lengths) for lengths, _, _ in measured)
    predicted = predicted_peaks(cfg, mode)["drafter_step"]
    gib, cuda = 2**30, dev.type == "cuda"
    return {
        "requested": backend, "backend": trainer.attention.backend, "compiled": trainer.attention.compiled,
        "reason": trainer.attention.reason,
        "first_step_s": round(first_seconds, 2), "step_s": round(step_seconds, 3),
        "compile_s": round(max(0.0, first_seconds - step_seconds), 1),
        "samples_per_s": round(d.batch_size / step_seconds, 3),
        "tokens_per_s": round(tokens / sum(seconds for _, seconds, _ in measured)),
        "steps_s": [round(seconds, 3) for _, seconds, _ in measured],
        "max_reserved_gib": round(torch.cuda.max_memory_reserved(dev) / gib, 2) if cuda else None,
        "max_allocated_gib": round(torch.cuda.max_memory_allocated(dev) / gib, 2) if cuda else None,
        "predicted_gib": None if predicted is None else round(predicted["bytes"] / gib, 2),
        # What the driver counts for this process (the CUDA context, NCCL's and the allocator's blocks),
        # beside the prediction with the model's CUDA context term added.
        "process_gib": process_memory_gib() if cuda else None,
        "predicted_process_gib": None if predicted is None else
        round((predicted["bytes"] + context_bytes()) / gib, 2),
        "graphs_at_warmup": graphs_at_warmup,
        "new_graphs_after_warmup": compiled_graphs() - graphs_at_warmup,
        "loss": measured[-1][2].loss, "blocks": measured[0][2].num_blocks,
        "shape": (f"{cfg.model.num_draft_layers} layers, H {TARGET_SHAPE[mode]['hidden']}, "
                  f"batch {d.batch_size} x {d.max_length}, {d.max_anchors} anchors, loss chunk "
                  f"{cfg.model.loss_chunk_size}, {cfg.model.dtype}"),
    }


def context_bytes() -> int:
    """The memory model's CUDA context term (memory_fit.CUDA_RUNTIME_BYTES)."""
    from dflash_ops.training.memory_fit import CUDA_RUNTIME_BYTES

    return CUDA_RUNTIME_BYTES


def process_memory_gib() -> float | None:
    """This process's GPU memory as nvidia-smi counts it (`--query-compute-apps`), or None where it is
    not listed (nvidia-smi missing, or a PID namespace that hides the process's own pid)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,"
                               "nounits"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in done.stdout.splitlines():
        fields = [x.strip() for x in line.split(",")]
        if len(fields) == 2 and fields[0] == str(os.getpid()) and fields[1].isdigit():
            return round(int(fields[1]) / 1024, 2)  # MiB
    return None


def speed_part(mode: str, device: str, backends: tuple[str, ...] = BACKENDS) -> dict:
    """Each of `backends` in a fresh process (its own memory peak and compilation), side by side; the dry
    run measures them in this process (it only shows that the code runs, in seconds of CPU)."""
    rows = {}
    for backend in backends:
        if mode == "dry":
            rows[backend] = measure(mode, device, backend)
            continue
        cmd = [sys.executable, "-m", "benchmarks.drafter_speed", "--one", backend, "--mode", mode,
               "--device", device]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"drafter_speed {backend}: exit {done.returncode}: {done.stderr[-2000:]}")
        rows[backend] = json.loads(done.stdout.strip().splitlines()[-1])
    return with_speedup({**rows, "reference": SPECFORGE, "shape": rows[backends[0]]["shape"]})


def with_speedup(part: dict) -> dict:
    """The part with the tiles' step over flex's, when both rows were measured."""
    if "auto" in part and "tiles" in part:
        return {**part, "speedup": round(part["tiles"]["step_s"] / part["auto"]["step_s"], 2)}
    return part


def table_rows(part: dict) -> list[str]:
    """The part's lines in the GPU check's table."""
    lines = [f"f. the drafter step by attention backend ({part['shape']}; measured steps change their "
             f"documents)",
             f"   {'backend':>22} | {'step s':>6} | {'samples/s':>9} | {'tokens/s':>8} | "
             f"{'1st step s':>10} | {'reserved GiB':>12} | {'predicted GiB':>13} | "
             f"{'nvidia-smi GiB':>14} | {'predicted':>9} | new graphs"]
    for name in (b for b in BACKENDS if b in part):
        r = part[name]
        label = f"{name}: {r['backend']}{' compiled' if r['compiled'] else ''}"
        lines.append(f"   {label:>22} | {r['step_s']:>6} | {r['samples_per_s']:>9} | "
                     f"{r['tokens_per_s']:>8} | {r['first_step_s']:>10} | {str(r['max_reserved_gib']):>12} | "
                     f"{str(r['predicted_gib']):>13} | {str(r.get('process_gib')):>14} | "
                     f"{str(r.get('predicted_process_gib')):>9} | {r['new_graphs_after_warmup']}")
    ref = part["reference"]
    if "auto" in part:
        lines += [f"   auto's reason: {part['auto']['reason']}; speed-up over the tiles: "
                  f"{part.get('speedup', 'tiles not run')}" + ("x" if "speedup" in part else "")]
    lines += [f"   reference: {ref['samples_per_s']} samples/s, {ref['tokens_per_s']} tokens/s "
              f"({ref['source']})"]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.drafter_speed",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("full", "dry"), default="full",
                        help="dry: the recipe at a tiny width (on CPU: --device cpu)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--one", choices=BACKENDS, help=argparse.SUPPRESS)  # a child: one backend
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.mode, args.device, args.one)))
        return 0
    part = speed_part(args.mode, args.device)
    print("\n".join(table_rows(part)))
    print(json.dumps(part))
    return 0


if __name__ == "__main__":
    sys.exit(main())
