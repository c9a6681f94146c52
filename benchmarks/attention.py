"""The drafter's attention at the paper's shape: dense `[Q, T+Q]` mask versus block-sparse tiles.

One drafter training step (forward, loss on the scored block positions, backward) on one packed
sequence of 3072 tokens with 512 anchors and blocks of 16 (8192 queries over 11264 keys), with a
small hidden size so that it runs on a CPU. Both paths use the same blocks, weights and inputs:

- dense (the previous path): `BlockBatch.attention_mask`, a `[Q, T+Q]` boolean mask, through SDPA;
- sparse (`dflash.model.attention.BlockSparseMask`): per tile of blocks, SDPA over the tile's context
  range and its own blocks, checkpointed.

Two scopes: the attention alone (q, k, v of that shape; forward, a loss, backward) and a whole
drafter step. Each includes building its mask. Peak memory is what torch's allocator holds beyond the
inputs and weights (`benchmarks.memory`); time is the best of interleaved repeats. The two steps'
losses and gradients are compared (float tolerance). Prints a table, then one JSON line.

    python -m benchmarks.attention                      # the paper's shape, hidden 128, 1 layer
    python -m benchmarks.attention --hidden 4096 --heads 32 --kv-heads 8 --device cuda
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hidden_states import best_seconds  # noqa: E402

from benchmarks.memory import peak_allocated_bytes  # noqa: E402
from dflash.model.drafter import DFlashDrafter, DrafterConfig  # noqa: E402
from dflash.model.loss import build_block_batch, dflash_loss, sample_anchors  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_steps(args, device: torch.device) -> tuple[dict, int, int]:
    """{scope: step(sparse) -> (loss, grads)} for the two scopes (the attention alone, a whole
    drafter step), the number of queries and of keys."""
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

    def new_batch():
        return build_block_batch(input_ids, loss_mask, cu_seqlens, positions, anchors, args.block_size,
                                 cfg.mask_token_id, gamma=7.0)

    def attention(sparse: bool):
        batch = new_batch()
        if sparse:
            out = batch.sparse_mask.attend(q, k, v, enable_gqa=heads != kv_heads)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.attention_mask,
                                                 enable_gqa=heads != kv_heads)
        loss = out.float().square().mean()
        return loss.detach(), torch.autograd.grad(loss, (q, k, v))

    def drafter_step(sparse: bool):
        batch = new_batch()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            mask = batch.sparse_mask if sparse else batch.attention_mask
            hidden = drafter(features, positions, batch.block_input_ids, batch.block_positions, mask)
            scored = batch.weights > 0
            loss = dflash_loss(drafter.logits(hidden[scored]), batch.labels[scored], batch.weights[scored])
        return loss.detach(), torch.autograd.grad(loss, params)

    return {"attention": attention, "drafter step": drafter_step}, n_queries, n_keys


def measure(args, device: torch.device) -> list[dict]:
    steps, n_queries, n_keys = make_steps(args, device)
    rows = []
    for scope, step in steps.items():
        (dense_loss, dense_grads), dense_peak = peak_allocated_bytes(lambda step=step: step(False), device)
        (sparse_loss, sparse_grads), sparse_peak = peak_allocated_bytes(lambda step=step: step(True), device)
        tolerance = dict(rtol=2e-2, atol=2e-3) if args.dtype == "bfloat16" else dict(rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(sparse_loss, dense_loss, **tolerance)
        for ours, reference in zip(sparse_grads, dense_grads, strict=True):
            torch.testing.assert_close(ours, reference, **tolerance)
        del dense_grads, sparse_grads
        t_dense, t_sparse = best_seconds([lambda step=step: step(False), lambda step=step: step(True)],
                                         args.repeats, device)
        rows.append({
            "scope": scope, "seq_len": args.seq_len, "anchors": args.anchors, "block_size": args.block_size,
            "queries": n_queries, "keys": n_keys, "dense_mask_entries": n_queries * n_keys,
            "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads, "layers": args.layers,
            "dtype": args.dtype, "device": str(device),
            "dense_peak_mib": round(dense_peak / 2**20, 1), "sparse_peak_mib": round(sparse_peak / 2**20, 1),
            "peak_ratio": round(sparse_peak / dense_peak, 3),
            "dense_ms": round(t_dense * 1e3, 1), "sparse_ms": round(t_sparse * 1e3, 1),
            "speedup": round(t_dense / t_sparse, 2),
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
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    for dtype in args.dtype:
        rows += measure(argparse.Namespace(**{**vars(args), "dtype": dtype}), device)
    first = rows[0]
    print(f"one sequence of {first['seq_len']} tokens, {first['anchors']} blocks of {first['block_size']}: "
          f"{first['queries']} queries x {first['keys']} keys; hidden {first['hidden']}, "
          f"{first['layers']} layer(s), {first['device']}")
    print(f"{'scope':>13} {'dtype':>9} | {'dense MiB':>9} {'sparse MiB':>10} {'ratio':>6} | {'dense ms':>9} "
          f"{'sparse ms':>9} {'speed-up':>8}")
    for r in rows:
        print(f"{r['scope']:>13} {r['dtype']:>9} | {r['dense_peak_mib']:>9} {r['sparse_peak_mib']:>10} "
              f"{r['peak_ratio']:>6} | {r['dense_ms']:>9} {r['sparse_ms']:>9} {r['speedup']:>7}x")
    print(json.dumps({"rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
