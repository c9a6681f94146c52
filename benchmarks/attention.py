"""The drafter's attention at the paper's shape: dense `[Q, T+Q]` mask, block-sparse tiles, FlexAttention.

One packed sequence of 3072 tokens with 512 anchors and blocks of 16 (8192 queries over 11264 keys:
the recipe's queries per document group), with a small hidden size so that it runs on a CPU. Every
path uses the same blocks and inputs:

- dense: `BlockBatch.attention_mask`, a `[Q, T+Q]` boolean mask, through SDPA;
- tiles (`dflash_ops.model.attention.BlockSparseMask`): per tile of blocks, SDPA over the tile's context
  range and its own blocks, checkpointed (the tile lists are built on the host);
- flex (`dflash_ops.model.flex.FlexBlockMask`): one `BlockMask` built on the device, `flex_attention`
  eager (its unfused reference: the whole score matrix) and compiled (`torch.compile`: fused
  kernels that skip empty tiles). torch has no FlexAttention backward on CPU: there flex's rows are
  forward only.

Two scopes: the attention alone (q, k, v of that shape; forward, and forward + a loss + backward)
and a whole drafter step (forward, loss, backward; dense and tiles, flex too on CUDA). Each includes
building its mask. Peak memory is what torch's allocator holds beyond the inputs and weights
(`benchmarks.memory`); time is the best of interleaved repeats after one warm-up (compiled: the
warm-up compiles). Every path's output (and gradients) are checked against the dense mask's.
Prints a table with each path's ratio to the tiles, then one JSON line.

    python -m benchmarks.attention                      # the paper's shape, hidden 128, 1 layer
    python -m benchmarks.attention --hidden 4096 --heads 32 --kv-heads 8 --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hidden_states import best_seconds  # noqa: E402

from benchmarks.memory import peak_allocated_bytes  # noqa: E402
from dflash_ops.model.drafter import DFlashDrafter, DrafterConfig  # noqa: E402
from dflash_ops.model.flex import padded_rows  # noqa: E402
from dflash_ops.model.loss import build_block_batch, dflash_loss, sample_anchors  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PATHS = ("dense", "tiles", "flex", "flex compiled")


def make_steps(args, device: torch.device) -> tuple[dict, int, int]:
    """{(scope, with backward): {path: step() -> (loss, grads)}}, the number of queries and of keys."""
    torch.manual_seed(0)
    heads, kv_heads, head_dim = args.heads, args.kv_heads, args.hidden // args.heads
    cfg = DrafterConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_attention_heads=heads,
                        num_key_value_heads=kv_heads, head_dim=head_dim, num_layers=args.layers,
                        num_target_features=5, block_size=args.block_size, mask_token_id=args.vocab - 1,
                        vocab_size=args.vocab)
    dtype = DTYPES[args.dtype]
    embed = torch.nn.Embedding(args.vocab, args.hidden).to(device, dtype)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False).to(device, dtype)
    drafter = DFlashDrafter(cfg, embed, head).to(device)
    tokens = args.seq_len
    g = torch.Generator().manual_seed(0)
    features = torch.randn(tokens, 5 * args.hidden, generator=g).to(device, dtype)
    input_ids = torch.randint(0, args.vocab - 1, (tokens,), generator=g).to(device)
    loss_mask = torch.ones(tokens, dtype=torch.int64, device=device)
    positions = torch.arange(tokens, device=device)
    cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32)
    anchors = [sample_anchors(loss_mask, args.block_size, args.anchors, g)]
    n_queries = anchors[0].numel() * args.block_size
    params = [p for p in drafter.parameters() if p.requires_grad]
    n_keys = tokens + n_queries
    q, k, v = (torch.randn(1, h, n, head_dim, generator=g).to(device, dtype).requires_grad_()
               for h, n in ((heads, n_queries), (kv_heads, n_keys), (kv_heads, n_keys)))
    # Compiled, the padded shapes a trainer gives it: whole 128-row tiles (here the shape's own).
    padding = dict(context_rows=padded_rows(tokens), query_rows=padded_rows(n_queries))

    def mask_of(path: str):
        batch = build_block_batch(input_ids, loss_mask, cu_seqlens, positions, anchors, args.block_size,
                                  cfg.mask_token_id, gamma=7.0)
        if path == "dense":
            return batch, batch.attention_mask
        if path == "tiles":
            return batch, batch.sparse_mask
        return batch, batch.block_mask("flex", compiled=path == "flex compiled", **padding)

    def attention(path: str, backward: bool):
        mask = mask_of(path)[1]
        with torch.set_grad_enabled(backward):
            if path == "dense":
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads)
            else:
                out = mask.attend(q, k, v, enable_gqa=heads != kv_heads)
            loss = out.float().square().mean()
        return loss.detach(), torch.autograd.grad(loss, (q, k, v)) if backward else ()

    def drafter_step(path: str):
        batch, mask = mask_of(path)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            hidden = drafter(features, positions, batch.block_input_ids, batch.block_positions, mask)
            rows = batch.scored_rows
            loss = dflash_loss(drafter.logits(hidden[rows]), batch.labels[rows], batch.weights[rows])
        return loss.detach(), torch.autograd.grad(loss, params)

    # torch has no FlexAttention backward on CPU; the eager flex step materialises every score.
    with_backward = [p for p in PATHS if device.type == "cuda" or not p.startswith("flex")]
    steps = {("attention", False): {p: (lambda p=p: attention(p, False)) for p in PATHS},
             ("attention", True): {p: (lambda p=p: attention(p, True)) for p in with_backward},
             ("drafter step", True): {p: (lambda p=p: drafter_step(p)) for p in with_backward if p != "flex"}}
    return {key: paths for key, paths in steps.items() if key[0] in args.scopes}, n_queries, n_keys


def measure(args, device: torch.device) -> list[dict]:
    steps, n_queries, n_keys = make_steps(args, device)
    tolerance = dict(rtol=2e-2, atol=2e-3) if args.dtype == "bfloat16" else dict(rtol=1e-4, atol=1e-5)
    rows = []
    for (scope, backward), paths in steps.items():
        results, peaks = {}, {}
        for path, step in paths.items():
            step()  # warm-up (compiled: the compilation) outside the peak
            results[path], peaks[path] = peak_allocated_bytes(step, device)
        dense_loss, dense_grads = results["dense"]
        for loss, grads in results.values():  # every path against the dense mask's
            torch.testing.assert_close(loss, dense_loss, **tolerance)
            for ours, reference in zip(grads, dense_grads, strict=True):
                torch.testing.assert_close(ours, reference, **tolerance)
        del results, dense_grads
        seconds = dict(zip(paths, best_seconds(list(paths.values()), args.repeats, device), strict=True))
        for path in paths:
            rows.append({
                "scope": scope, "backward": backward, "path": path, "seq_len": args.seq_len,
                "anchors": args.anchors, "block_size": args.block_size, "queries": n_queries, "keys": n_keys,
                "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads, "layers": args.layers,
                "dtype": args.dtype, "device": str(device), "threads": args.threads,
                "peak_mib": round(peaks[path] / 2**20, 1), "ms": round(seconds[path] * 1e3, 1),
                "peak_vs_tiles": round(peaks[path] / peaks["tiles"], 3),
                "time_vs_tiles": round(seconds[path] / seconds["tiles"], 3),
            })
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.attention",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=3072, help="context tokens (paper: max length 3072)")
    parser.add_argument("--anchors", type=int, default=512, help="blocks per sequence (paper: 512)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--dtype", nargs="+", choices=DTYPES, default=["float32"],
                        help="bfloat16 too: slow on CPUs without native bf16 matrix units")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--scopes", nargs="+", choices=["attention", "drafter step"],
                        default=["attention", "drafter step"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for dtype in args.dtype:
        rows += measure(argparse.Namespace(**{**vars(args), "dtype": dtype}), device)
    first = rows[0]
    print(f"one sequence of {first['seq_len']} tokens, {first['anchors']} blocks of {first['block_size']}: "
          f"{first['queries']} queries x {first['keys']} keys; hidden {first['hidden']}, {first['heads']}/"
          f"{first['kv_heads']} heads, {first['layers']} layer(s), {first['device']}, "
          f"{args.threads} thread(s); load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{'scope':>13} {'pass':>8} {'dtype':>9} {'path':>13} | {'peak MiB':>9} {'x tiles':>7} | "
          f"{'ms':>9} {'x tiles':>7}")
    for r in rows:
        print(f"{r['scope']:>13} {'fwd+bwd' if r['backward'] else 'forward':>8} {r['dtype']:>9} "
              f"{r['path']:>13} | {r['peak_mib']:>9} {r['peak_vs_tiles']:>7} | {r['ms']:>9} "
              f"{r['time_vs_tiles']:>7}")
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
