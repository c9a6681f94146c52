"""The drafter's step at Qwen3-8B's width: the lm_head + cross entropy unchunked versus chunked.

One drafter training step (forward, weighted cross entropy on the scored block positions, backward)
on one packed sequence with random weights and features: H 4096, 32 heads and 8 KV heads of 128,
MLP 12288, vocabulary 151936, k = 5 target layers, blocks of 16, bf16 autocast over fp32 master
weights around a bf16 embedding and lm_head (`model.dtype: bfloat16`), the attention a run uses on the
device (`dflash_ops.model.flex.choose_attention`: FlexAttention compiled on CUDA, the tiles on CPU). The two
paths share the code the trainer runs (`dflash_ops.training.trainer.scored_loss`):

- unchunked (`model.loss_chunk_size: null`): the scored positions' `[scored, vocab]` logits at once;
- chunked (`model.loss_chunk_size`, default 512): `dflash_ops.model.loss.chunked_head_loss`.

Every configuration runs in a fresh process, on CPU under an address-space limit (a shape that
does not fit is reported as such): the model is built, one warm-up step runs at a few anchors,
then the measured step. On CPU the peak is the process's resident high-water mark during the step
above its size before it (`benchmarks.memory.peak_rss_bytes`), when it holds what a trainer holds
between steps: the weights and the previous step's gradients, which the step frees and rebuilds
(`zero_grad(set_to_none=True)`, as the trainer does). On CUDA it is `max_memory_allocated`:
everything the GPU holds. AdamW's state and step are left out unless `--optimizer` (the GPU check
adds them). Prints a table, then one JSON line.

    python -m benchmarks.drafter_step                      # 1 layer, 256 and 512 anchors, 20 GiB
    python -m benchmarks.drafter_step --layers 5 --anchors 128 256
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.memory import peak_rss_bytes
from dflash_ops.core.config import DEFAULT_LOSS_CHUNK_SIZE
from dflash_ops.model.drafter import DFlashDrafter, DrafterConfig
from dflash_ops.model.flex import choose_attention
from dflash_ops.model.loss import build_block_batch, sample_anchors
from dflash_ops.training.trainer import scored_loss

ROOT = Path(__file__).resolve().parent.parent
WARMUP_ANCHORS = 4


def build_step(shape: dict, device: torch.device):
    """(step(anchors) -> (loss, grad norm), drafter): one step of a random drafter of `shape`."""
    torch.manual_seed(0)
    hidden, vocab = shape["hidden"], shape["vocab"]
    cfg = DrafterConfig(hidden_size=hidden, intermediate_size=shape["intermediate"],
                        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                        head_dim=shape["head_dim"], num_layers=shape["layers"], num_target_features=5,
                        block_size=shape["block_size"], mask_token_id=vocab - 1, vocab_size=vocab)
    # The target's frozen embedding and head in bf16, initialised in place (no fp32 copy of 2.5 GB).
    embed = torch.nn.Embedding(vocab, hidden, device=device, dtype=torch.bfloat16)
    head = torch.nn.Linear(hidden, vocab, bias=False, device=device, dtype=torch.bfloat16)
    for frozen in (embed, head):
        frozen.requires_grad_(False).weight.normal_(std=0.02)
    with device:  # initialised where it runs: no host copy of a GPU's weights
        drafter = DFlashDrafter(cfg, embed, head)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=6e-4) if shape["optimizer"] else None
    tokens = shape["seq_len"]
    g = torch.Generator().manual_seed(0)
    features = torch.randn(tokens, 5 * hidden, generator=g).to(device, torch.bfloat16)
    input_ids = torch.randint(0, vocab - 1, (tokens,), generator=g).to(device)
    loss_mask = torch.ones(tokens, dtype=torch.int64, device=device)
    positions = torch.arange(tokens, device=device)
    cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32)
    # The attention a run uses on this device (FlexAttention compiled on CUDA), at the shape's size.
    attention = choose_attention("auto", device)
    padding = dict(context_rows=tokens, query_rows=shape["anchors"] * cfg.block_size)

    def step(n_anchors: int):
        anchors = [sample_anchors(loss_mask, cfg.block_size, n_anchors, torch.Generator().manual_seed(1))]
        batch = build_block_batch(input_ids, loss_mask, cu_seqlens, positions, anchors, cfg.block_size,
                                  cfg.mask_token_id, gamma=7.0)
        for p in params:
            p.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            mask = batch.block_mask(attention.backend, compiled=attention.compiled, **padding)
            out = drafter(features, positions, batch.block_input_ids, batch.block_positions, mask)
            loss, _, _ = scored_loss(drafter, out, batch, batch.weights.sum(), shape["chunk_size"])
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        if optimizer is not None:
            optimizer.step()
        return float(loss), float(grad_norm)

    return step, drafter


def measure_one(shape: dict, device: torch.device) -> dict:
    """Build, warm up, and measure `repeats` steps of `shape` in this process: the fastest step's
    time and the peak over them. On CUDA the peak is everything allocated (weights, gradients,
    AdamW state, activations: what a GPU must hold); on CPU the step's growth above the process."""
    step, _ = build_step(shape, device)
    step(shape.get("warmup_anchors", WARMUP_ANCHORS))

    def timed():
        seconds = []
        for _ in range(shape.get("repeats", 1)):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            figures = step(shape["anchors"])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - started)
        return figures, min(seconds)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        (loss, grad_norm), seconds = timed()
        peak, scope = torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    else:
        ((loss, grad_norm), seconds), peak = peak_rss_bytes(timed)
        scope = "resident growth during the step"
    return {**shape, "device": str(device), "peak_gib": round(peak / 2**30, 3), "peak_scope": scope,
            "seconds": round(seconds, 2), "samples_per_s": round(1 / seconds, 3), "loss": loss,
            "grad_norm": grad_norm}


class DidNotFit(RuntimeError):
    """A configuration's step ran out of the memory it was allowed."""


def measure_in_subprocess(shape: dict, device: str, threads: int,
                          memory_limit_gib: float | None = None) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.drafter_step", "--one", json.dumps(shape), "--device", device,
           "--threads", str(threads)]
    if memory_limit_gib is not None:
        cmd += ["--address-limit-gib", str(memory_limit_gib)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        if "DefaultCPUAllocator: can't allocate memory" in done.stderr or "MemoryError" in done.stderr:
            raise DidNotFit(f"{shape}: does not fit in {memory_limit_gib} GiB")
        raise SystemExit(f"{shape}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def relative_difference(value: float, reference: float) -> float:
    return abs(value - reference) / abs(reference)


def compare(unchunked: dict, chunked: dict) -> dict:
    """The side-by-side figures of one shape, measured in the same run."""
    return {
        "layers": chunked["layers"], "anchors": chunked["anchors"], "chunk_size": chunked["chunk_size"],
        "scored": chunked["anchors"] * (chunked["block_size"] - 1),
        "unchunked_peak_gib": unchunked["peak_gib"], "chunked_peak_gib": chunked["peak_gib"],
        "peak_ratio": round(chunked["peak_gib"] / unchunked["peak_gib"], 3),
        "unchunked_s": unchunked["seconds"], "chunked_s": chunked["seconds"],
        "time_ratio": round(chunked["seconds"] / unchunked["seconds"], 3),
        "loss_rel_diff": relative_difference(chunked["loss"], unchunked["loss"]),
        "grad_norm_rel_diff": relative_difference(chunked["grad_norm"], unchunked["grad_norm"]),
    }


def print_table(rows: list[dict], alone: list[dict]) -> None:
    print(f"{'layers':>6} {'anchors':>7} {'chunk':>5} | {'unchunked GiB':>13} {'chunked GiB':>11} "
          f"{'ratio':>6} | {'unchunked s':>11} {'chunked s':>9} {'ratio':>6} | loss diff")
    for r in rows:
        print(f"{r['layers']:>6} {r['anchors']:>7} {r['chunk_size']:>5} | {r['unchunked_peak_gib']:>13} "
              f"{r['chunked_peak_gib']:>11} {r['peak_ratio']:>6} | {r['unchunked_s']:>11} "
              f"{r['chunked_s']:>9} {r['time_ratio']:>6} | {r['loss_rel_diff']:.1e}")
    for r in alone:
        print(f"{r['layers']:>6} {r['anchors']:>7} {r['chunk_size']:>5} | {'(no fit)':>13} "
              f"{r['peak_gib']:>11} {'':>6} | {'':>11} {r['seconds']:>9}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.drafter_step",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1])
    parser.add_argument("--anchors", type=int, nargs="+", default=[256, 512],
                        help="blocks in the sequence (paper: 512 per 3072 tokens)")
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=12288)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_LOSS_CHUNK_SIZE)
    parser.add_argument("--memory-limit-gib", type=float, default=20.0,
                        help="on CPU, the address-space limit of each configuration's process: past it the "
                             "step fails with an allocation error instead of pressing the machine")
    parser.add_argument("--address-limit-gib", type=float, help=argparse.SUPPRESS)  # a child's limit
    parser.add_argument("--optimizer", action="store_true", help="include the AdamW step")
    parser.add_argument("--repeats", type=int, default=1, help="measured steps (the fastest is reported)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="fresh processes per path, alternating (the fastest round's time is reported)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a JSON shape: measure it in this process
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.one:
        if args.address_limit_gib is not None:
            limit = int(args.address_limit_gib * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        print(json.dumps(measure_one(json.loads(args.one), torch.device(args.device))))
        return 0
    base = {"seq_len": args.seq_len, "block_size": args.block_size, "hidden": args.hidden,
            "intermediate": args.intermediate, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "vocab": args.vocab, "optimizer": args.optimizer,
            "repeats": args.repeats}
    rows, alone = [], []
    for layers in args.layers:
        for anchors in args.anchors:
            shape = {**base, "layers": layers, "anchors": anchors}
            limit = args.memory_limit_gib if args.device == "cpu" else None  # CUDA reserves address space
            measure = functools.partial(measure_in_subprocess, device=args.device, threads=args.threads,
                                        memory_limit_gib=limit)
            chunked = measure({**shape, "chunk_size": args.chunk_size})
            try:
                unchunked = measure({**shape, "chunk_size": None})
            except DidNotFit:
                alone.append(chunked)
                continue
            # Further rounds alternate the two paths, so that a busy machine's slow minutes fall on both;
            # each path's fastest round counts.
            for _ in range(args.rounds - 1):
                for best, chunk in ((unchunked, None), (chunked, args.chunk_size)):
                    best["seconds"] = min(best["seconds"], measure({**shape, "chunk_size": chunk})["seconds"])
            rows.append(compare(unchunked, chunked))
    print(f"one sequence of {args.seq_len} tokens, blocks of {args.block_size}; H {args.hidden}, "
          f"{args.heads}/{args.kv_heads} heads of {args.head_dim}, vocab {args.vocab}; bf16 autocast over "
          f"fp32 master weights; {args.device}, {args.threads} thread(s); peak = resident high-water mark "
          f"of the step in a fresh process (limit {args.memory_limit_gib} GiB of address space); "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    print_table(rows, alone)
    print(json.dumps({"rows": rows, "chunked_only": alone}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
