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

The result equals SDPA with the dense mask of `dflash.loss.build_block_attention_mask` up to
float rounding (the tests pin it in fp32 and bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

TILE_QUERIES = 128  # queries per tile: fewer Python steps against less masked work in a tile


@dataclass
class BlockSparseMask:
    """Which keys each block sees: context rows `[context_start, context_end)` and its own block."""

    context_start: torch.Tensor  # [n_blocks] int64, first context row of the block's document
    context_end: torch.Tensor    # [n_blocks] int64, one past the last context row before its anchor
    block_size: int
    n_context: int               # T: the block keys start at row T of k and v
    tiles: list[tuple[int, int, int, int]]  # (first block, last block + 1, context start, context end)

    @classmethod
    def from_blocks(cls, cu_seqlens: torch.Tensor, block_doc: torch.Tensor, block_anchor: torch.Tensor,
                    block_size: int, tile_queries: int = TILE_QUERIES) -> BlockSparseMask:
        """The mask of blocks whose documents are `cu_seqlens` `[B+1]` of the packed context;
        `block_doc`/`block_anchor` `[n_blocks]`, in document order, anchors sorted in each."""
        bounds = cu_seqlens.to(torch.int64).cpu()
        doc, anchor = block_doc.to(torch.int64).cpu(), block_anchor.to(torch.int64).cpu()
        start = bounds[doc]
        end = torch.minimum(start + anchor, bounds[doc + 1])
        per_tile = max(1, tile_queries // block_size)
        tiles = []
        docs, starts, ends = doc.tolist(), start.tolist(), end.tolist()
        first = 0
        for j in range(1, len(docs) + 1):
            if j == len(docs) or docs[j] != docs[first] or j - first == per_tile:
                tiles.append((first, j, starts[first], max(ends[first:j])))
                first = j
        return cls(start, end, block_size, int(bounds[-1]), tiles)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> torch.Tensor:
        """Attention of q `[1, heads, Q, D]` over k, v `[1, kv_heads, T+Q, D]` (context rows first,
        then the block rows), as SDPA with the dense block mask would give it."""
        outputs = []
        for first, last, ctx_start, ctx_end in self.tiles:
            q0, q1 = first * self.block_size, last * self.block_size
            query_end = (self.context_end[first:last] - ctx_start).to(q.device)
            args = (q[:, :, q0:q1], k, v, ctx_start, ctx_end, self.n_context + q0, query_end,
                    self.block_size, enable_gqa)
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
                    block_start: int, query_end: torch.Tensor, block_size: int,
                    enable_gqa: bool) -> torch.Tensor:
    """One tile: its queries over context rows [ctx_start, ctx_end) and its own block rows.
    `query_end` `[tile blocks]`: each block's context end, relative to ctx_start."""
    n_queries = q.shape[2]
    block_end = block_start + n_queries
    keys = torch.cat([k[:, :, ctx_start:ctx_end], k[:, :, block_start:block_end]], dim=2)
    values = torch.cat([v[:, :, ctx_start:ctx_end], v[:, :, block_start:block_end]], dim=2)
    block_of_query = torch.arange(n_queries, device=q.device) // block_size
    sees_context = (torch.arange(ctx_end - ctx_start, device=q.device)[None, :]
                    < query_end.repeat_interleave(block_size)[:, None])
    sees_block = block_of_query[:, None] == block_of_query[None, :]
    mask = torch.cat([sees_context, sees_block], dim=1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=enable_gqa)
