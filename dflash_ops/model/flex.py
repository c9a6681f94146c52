"""The drafter's block pattern as FlexAttention's `BlockMask`: built once per pattern, on the device.

A query of block j (offset i) sees the context rows of its own document at positions before
anchor_j and its own block (`dflash_ops.model.loss.build_block_attention_mask`); a sliding-window layer
keeps of that the keys at positions anchor_j+i-W+1 .. anchor_j+i
(`dflash_ops.model.drafter.sliding_window_mask`). `FlexBlockMask` holds that pattern as a few device tensors
(each key row's document and position, each block's document and anchor) and its `mask_mod` reads them:
`create_block_mask` turns it into the `BlockMask` that `flex_attention` skips empty 128 x 128 tiles with, so
the work follows the allowed entries, and nothing goes back to the host (no `.tolist()`, `.item()` or
`.cpu()`, no per-tile copies).

Shapes: the compiled kernel sees `[context_rows + query_rows]` keys and `query_rows` queries, the
real ones padded with zero rows up to fixed sizes (the trainer's `data.max_length` and
`data.max_anchors` x b, rounded up to flex's tile), so one compilation serves every step whatever
its anchors and documents. A padding key belongs to no document; a padding query belongs to a
block of its own that sees only its own (zero) keys, and is cut off the output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dflash_ops.core.sections import ATTENTION_BACKENDS

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # torch without FlexAttention: the tile path (`dflash_ops.model.attention`) serves
    BlockMask = create_block_mask = flex_attention = None

TILE = 128  # FlexAttention's tile: padded lengths are multiples of it
_NO_DOCUMENT, _PADDING_BLOCK = -1, -2
_COMPILED: dict[str, object] = {}


def flex_unavailable() -> str | None:
    """Why FlexAttention cannot run here (None: it can)."""
    return "torch has no torch.nn.attention.flex_attention" if flex_attention is None else None


@dataclass(frozen=True)
class AttentionChoice:
    """The drafter attention a run uses on its device, and why (the start's log says it)."""

    backend: str    # flex | tiles
    compiled: bool  # flex_attention (and its masks) under torch.compile
    reason: str


def choose_attention(requested: str, device: torch.device) -> AttentionChoice:
    """`model.attention_backend` on `device`: `auto` is FlexAttention compiled on CUDA and the tiles
    elsewhere (torch has no FlexAttention backward on CPU); `flex` where it cannot train is refused."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {requested!r}: expected one of {', '.join(ATTENTION_BACKENDS)}")
    if requested == "tiles":
        return AttentionChoice("tiles", False, "model.attention_backend: tiles")
    missing = flex_unavailable()
    if missing is None and device.type != "cuda":
        missing = f"torch {torch.__version__} has no FlexAttention backward on {device.type}"
    if missing is None:
        return AttentionChoice("flex", True, f"FlexAttention under torch.compile on {device.type}")
    if requested == "flex":
        raise ValueError(f"model.attention_backend: flex cannot train here: {missing}")
    return AttentionChoice("tiles", False, f"block-sparse tiles of SDPA: {missing}")


def padded_rows(n: int, at_least: int = 0) -> int:
    """`n` rows rounded up to a multiple of `TILE`, and to `at_least` (itself rounded up) if more."""
    return -(-max(n, at_least, 1) // TILE) * TILE


def _compiled(fn, compiled: bool):
    """`fn` itself, or under torch.compile (one wrapper per function: fixed shapes, no dynamic ones)."""
    if not compiled:
        return fn
    if fn.__name__ not in _COMPILED:
        _COMPILED[fn.__name__] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn.__name__]


def _pad_rows(x: torch.Tensor, rows: int, value: int = 0) -> torch.Tensor:
    """x `[n, ...]` or `[1, heads, n, D]` padded with `value` rows up to `rows` (along its row axis)."""
    if x.dim() == 1:
        return F.pad(x, (0, rows - x.shape[0]), value=value)
    return F.pad(x, (0, 0, 0, rows - x.shape[2]), value=value)


@dataclass
class FlexBlockMask:
    """The block pattern of one document group on the device; `attend` runs `flex_attention` on it."""

    key_doc: torch.Tensor      # [context_rows + query_rows] document of each context key row; -1 elsewhere
    key_pos: torch.Tensor      # [context_rows + query_rows] position of each context key row in its document
    block_doc: torch.Tensor    # [query_rows / b] document of each block; -2 for a padding block
    block_anchor: torch.Tensor  # [query_rows / b]
    block_size: int
    n_context: int             # T: the real context rows (the block keys start at row T of k and v)
    n_queries: int             # Q: the real block rows
    context_rows: int          # T padded
    query_rows: int            # Q padded
    window: int | None = None  # the sliding window W; None: full attention
    compiled: bool = False     # flex_attention and create_block_mask under torch.compile
    _block_mask: object = field(default=None, repr=False)
    _windows: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_blocks(cls, context_doc: torch.Tensor, context_pos: torch.Tensor, block_doc: torch.Tensor,
                    block_anchor: torch.Tensor, block_size: int, *, context_rows: int = 0,
                    query_rows: int = 0, compiled: bool = False) -> FlexBlockMask:
        """The pattern of blocks `block_doc`/`block_anchor` `[n_blocks]` over the packed context whose
        rows have documents `context_doc` and positions `context_pos` `[T]`, all on one device; padded
        to at least `context_rows` context rows and `query_rows` block rows (multiples of `TILE`)."""
        n_context, n_queries = context_doc.shape[0], block_doc.shape[0] * block_size
        context_rows = padded_rows(n_context, context_rows)
        query_rows = padded_rows(n_queries, query_rows)
        if query_rows % block_size:
            raise ValueError(f"block size {block_size} does not divide {query_rows} padded queries")
        key_doc = _pad_rows(context_doc.to(torch.int32), context_rows + query_rows, _NO_DOCUMENT)
        key_pos = _pad_rows(context_pos.to(torch.int32), context_rows + query_rows)
        blocks = query_rows // block_size
        return cls(key_doc, key_pos, _pad_rows(block_doc.to(torch.int32), blocks, _PADDING_BLOCK),
                   _pad_rows(block_anchor.to(torch.int32), blocks), block_size, n_context, n_queries,
                   context_rows, query_rows, None, compiled)

    def with_window(self, window: int) -> FlexBlockMask:
        """The pattern of a sliding-window layer of `window` tokens over the same blocks (one per
        window, shared by its layers)."""
        if window not in self._windows:
            self._windows[window] = dataclasses.replace(self, window=window, _block_mask=None, _windows={})
        return self._windows[window]

    def mask_mod(self):
        """FlexAttention's `mask_mod(batch, head, query, key)` of this pattern."""
        key_doc, key_pos = self.key_doc, self.key_pos
        block_doc, block_anchor = self.block_doc, self.block_anchor
        size, context_rows, window = self.block_size, self.context_rows, self.window

        def sees(batch, head, query, key):
            block, offset = query // size, query % size
            anchor = block_anchor[block]
            context = (key_doc[key] == block_doc[block]) & (key_pos[key] < anchor)
            own_block = (key - context_rows) // size == block  # context rows give negative blocks
            if window is not None:
                context = context & (key_pos[key] > anchor + offset - window)
                lag = offset - (key - context_rows) % size
                own_block = own_block & (lag >= 0) & (lag < window)
            return context | own_block

        return sees

    def block_mask(self) -> BlockMask:
        """The `BlockMask` (built on first use, on the tensors' device)."""
        if self._block_mask is None:
            rows = self.context_rows + self.query_rows
            self._block_mask = _compiled(create_block_mask, self.compiled)(
                self.mask_mod(), None, None, self.query_rows, rows, device=self.key_doc.device)
        return self._block_mask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, enable_gqa: bool) -> torch.Tensor:
        """Attention of q `[1, heads, Q, D]` over k, v `[1, kv_heads, T+Q, D]` (context rows first,
        then the block rows), as SDPA with the dense block mask would give it."""
        n_context, rows = self.n_context, self.query_rows
        if q.shape[2] != self.n_queries or k.shape[2] != n_context + self.n_queries:
            raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not match the pattern's "
                             f"{self.n_queries} queries over {n_context} + {self.n_queries} keys")

        def keys(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([_pad_rows(x[:, :, :n_context], self.context_rows),
                              _pad_rows(x[:, :, n_context:], rows)], dim=2)

        out = _compiled(flex_attention, self.compiled)(_pad_rows(q, rows), keys(k), keys(v),
                                                        block_mask=self.block_mask(), enable_gqa=enable_gqa)
        return out[:, :, :self.n_queries]
