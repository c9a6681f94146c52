"""Block-sparse attention for the drafter, without the dense `[Q, T+Q]` mask.

A query of block j sees the context tokens of its own document before anchor_j, and its own block.
In the packed context the first set is one contiguous row range `[doc_start, doc_start + anchor_j)`
(context positions count 0, 1, ... within each document), so the allowed keys of a block are two
ranges: a prefix of its document's context and its own b block keys.

`BlockSparseMask` cuts the blocks into tiles of consecutive blocks of one document (about
`TILE_QUERIES` queries each; anchors are sorted within a document, so the tile's context range is
its last block's prefix). Each tile runs one SDPA over its context range and its own block keys
with a small `[tile queries, range + tile queries]` mask. Under autograd each tile is
checkpointed: only the inputs (views of the layer's q, k, v) are kept, and the tile's keys and
mask are rebuilt in the backward pass, so no tile's working set outlives it. Work and memory
follow the allowed entries (plus the waste inside a tile), not Q x (T+Q).

`with_window(W)` is the pattern of a sliding-window layer (`dflash_ops.model.drafter.sliding_window_mask`: the
query at block offset i of a block anchored at a sees the context positions a+i-W+1 .. a-1 and its
block's offsets i-W+1 .. i). Its tiles start at their first block's window and also end where a
tile's context range would pass W + `TILE_QUERIES` rows, so a sliding layer's work follows W, not
the documents' lengths.

The result equals SDPA with the dense mask of `dflash_ops.model.loss.build_block_attention_mask` (of the same
window) up to float rounding (the tests pin it in fp32 and bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

TILE_QUERIES = 128  # queries per tile: fewer Python steps against less masked work in a tile


@dataclass
class BlockSparseMask:
    """Which keys each block sees: context rows `[context_start, context_end)` and its own block
    (with a `window`: the part of them that the sliding window leaves each query)."""

    context_start: torch.Tensor  # [n_blocks] int64, first context row of the block's document
    context_end: torch.Tensor    # [n_blocks] int64, one past the last context row before its anchor
    block_size: int
    n_context: int               # T: the block keys start at row T of k and v
    tiles: list[tuple[int, int, int, int]]  # (first block, last block + 1, context start, context end)
    window: int | None           # the sliding window W; None: full attention
    window_start: torch.Tensor   # [n_blocks] int64, the first context row the anchor's query may see
    blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]  # what from_blocks was given

    @classmethod
    def from_blocks(cls, cu_seqlens: torch.Tensor, block_doc: torch.Tensor, block_anchor: torch.Tensor,
                    block_size: int, tile_queries: int = TILE_QUERIES,
                    window: int | None = None) -> BlockSparseMask:
        """The mask of blocks whose documents are `cu_seqlens` `[B+1]` of the packed context;
        `block_doc`/`block_anchor` `[n_blocks]`, in document order, anchors sorted in each;
        `window`: that of a sliding-window layer."""
        bounds = cu_seqlens.to(torch.int64).cpu()
        doc, anchor = block_doc.to(torch.int64).cpu(), block_anchor.to(torch.int64).cpu()
        start = bounds[doc]
        end = torch.minimum(start + anchor, bounds[doc + 1])
        # The anchor's query sees rows from here on (offset i's from i rows later), within its document.
        window_start = start if window is None else start + anchor - window + 1
        low = torch.minimum(torch.maximum(start, window_start), end)
        per_tile = max(1, tile_queries // block_size)
        span = None if window is None else window + tile_queries  # the most context rows of a tile
        tiles = []
        docs, lows, ends = doc.tolist(), low.tolist(), end.tolist()
        first = 0
        for j in range(1, len(docs) + 1):
            if (j == len(docs) or docs[j] != docs[first] or j - first == per_tile
                    or (span is not None and ends[j] - lows[first] > span)):
                tiles.append((first, j, lows[first], max(ends[first:j])))
                first = j
        return cls(start, end, block_size, int(bounds[-1]), tiles, window, window_start,
                   (cu_seqlens, block_doc, block_anchor, tile_queries))

    def with_window(self, window: int) -> BlockSparseMask:
        """The pattern of a sliding-window layer of `window` tokens over the same blocks."""
        cu_seqlens, block_doc, block_anchor, tile_queries = self.blocks
        return BlockSparseMask.from_blocks(cu_seqlens, block_doc, block_anchor, self.block_size, tile_queries,
                                           window)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> torch.Tensor:
        """Attention of q `[1, heads, Q, D]` over k, v `[1, kv_heads, T+Q, D]` (context rows first,
        then the block rows), as SDPA with the dense block mask would give it."""
        outputs = []
        for first, last, ctx_start, ctx_end in self.tiles:
            q0, q1 = first * self.block_size, last * self.block_size
            query_end = (self.context_end[first:last] - ctx_start).to(q.device)
            query_start = (None if self.window is None
                           else (self.window_start[first:last] - ctx_start).to(q.device))
            args = (q[:, :, q0:q1], k, v, ctx_start, ctx_end, self.n_context + q0, query_start, query_end,
                    self.block_size, self.window, enable_gqa)
            if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
                outputs.append(checkpoint(_tile_attention, *args, use_reentrant=False,
                                          preserve_rng_state=False))
            else:
                outputs.append(_tile_attention(*args))
        if not outputs:
            # No block: the empty dense call still puts q, k and v in the graph (under DDP every
            # rank needs a gradient, zero or not, for every weight).
            empty = torch.zeros(0, k.shape[2], dtype=torch.bool, device=q.device)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=empty, enable_gqa=enable_gqa)
        return torch.cat(outputs, dim=2)


def _tile_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx_start: int, ctx_end: int,
                    block_start: int, query_start: torch.Tensor | None, query_end: torch.Tensor,
                    block_size: int, window: int | None, enable_gqa: bool) -> torch.Tensor:
    """One tile: its queries over context rows [ctx_start, ctx_end) and its own block rows.
    `query_end` `[tile blocks]`: each block's context end, relative to ctx_start; with a `window`,
    `query_start` `[tile blocks]`: the first row its anchor's query sees (offset i's: i rows later)."""
    n_queries = q.shape[2]
    block_end = block_start + n_queries
    keys = torch.cat([k[:, :, ctx_start:ctx_end], k[:, :, block_start:block_end]], dim=2)
    values = torch.cat([v[:, :, ctx_start:ctx_end], v[:, :, block_start:block_end]], dim=2)
    query = torch.arange(n_queries, device=q.device)
    block_of_query, offset = query // block_size, query % block_size
    rows = torch.arange(ctx_end - ctx_start, device=q.device)[None, :]
    sees_context = rows < query_end.repeat_interleave(block_size)[:, None]
    sees_block = block_of_query[:, None] == block_of_query[None, :]
    if window is not None:
        sees_context &= rows >= (query_start.repeat_interleave(block_size) + offset)[:, None]
        lag = offset[:, None] - offset[None, :]
        sees_block &= (lag >= 0) & (lag < window)
    mask = torch.cat([sees_context, sees_block], dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=enable_gqa)
