"""Anchors, block batches, the block attention mask and the weighted loss (DFlash's decay, or D-PACE).

Two bugs that public trainers shipped are pinned by the tests of this file:
- labels are NOT shifted: block position k is scored against the token at anchor + k;
- a block sees context positions strictly before its anchor (`kv < anchor`, not `<=`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from dflash_ops.model.attention import BlockSparseMask
from dflash_ops.model.drafter import compile_rows_dynamic, sliding_window_mask
from dflash_ops.model.flex import FlexBlockMask
from dflash_ops.model.hidden_states import document_ids


def sample_anchors(loss_mask: torch.Tensor, block_size: int, max_anchors: int,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """A sorted random subset (at most `max_anchors`) of one document's valid anchor positions:
    a with loss_mask[a] = loss_mask[a+1] = 1 and a <= S - block_size."""
    length = loss_mask.numel()
    last = length - block_size
    if last < 0 or length < 2:
        return torch.zeros(0, dtype=torch.int64)
    mask = loss_mask.to(torch.bool).cpu()
    valid = mask[: last + 1] & mask[1: last + 2]
    candidates = valid.nonzero().squeeze(1)
    if candidates.numel() > max_anchors:
        chosen = torch.randperm(candidates.numel(), generator=generator)[:max_anchors]
        candidates = candidates[chosen.sort().values]
    return candidates


@dataclass
class BlockBatch:
    """The drafter's inputs and targets for a packed batch; Q = n_blocks * block_size.
    Its attention masks are built on first use: the block-sparse one the trainer uses
    (`sparse_mask`, a few ranges per block) and the dense `[Q, T+Q]` reference (`attention_mask`)."""

    block_input_ids: torch.Tensor  # [Q] anchor token then mask tokens, per block
    block_positions: torch.Tensor  # [Q] anchor + k, position within the document
    labels: torch.Tensor           # [Q] token at anchor + k (unshifted); 0 where unscored
    weights: torch.Tensor          # [Q] float32 loss weights, 0 where unscored
    context_doc: torch.Tensor      # [T] document of each context token
    context_pos: torch.Tensor      # [T] position of each context token within its document
    block_doc: torch.Tensor        # [n_blocks]
    block_anchor: torch.Tensor     # [n_blocks]
    block_size: int
    cu_seqlens: torch.Tensor       # [B+1] document boundaries of the context

    @cached_property
    def attention_mask(self) -> torch.Tensor:
        """[Q, T + Q] bool, True = may attend."""
        return build_block_attention_mask(self.context_doc, self.context_pos, self.block_doc,
                                          self.block_anchor, self.block_size)

    @cached_property
    def sparse_mask(self) -> BlockSparseMask:
        """The same pattern as `attention_mask`, as ranges per block (`dflash_ops.model.attention`)."""
        return BlockSparseMask.from_blocks(self.cu_seqlens, self.block_doc, self.block_anchor,
                                           self.block_size)

    @cached_property
    def scored_rows(self) -> torch.Tensor:
        """`[scored]` int64: the block rows with a weight, in order (what the lm_head runs on). Finding
        them waits for the device once: read it while laying out a step, not inside its forward."""
        return (self.weights > 0).nonzero().squeeze(1)

    def block_mask(self, backend: str, context_rows: int = 0, query_rows: int = 0,
                   compiled: bool = False) -> BlockSparseMask | FlexBlockMask:
        """The pattern the drafter attends with: `sparse_mask` (backend `tiles`) or, for `flex`, a
        `FlexBlockMask` on the batch's device, padded to at least `context_rows` + `query_rows`
        (`dflash_ops.model.flex`; `compiled`: under torch.compile)."""
        if backend == "tiles":
            return self.sparse_mask
        if backend != "flex":
            raise ValueError(f"attention backend {backend!r}: expected tiles or flex")
        return FlexBlockMask.from_blocks(self.context_doc, self.context_pos, self.block_doc,
                                         self.block_anchor, self.block_size, context_rows=context_rows,
                                         query_rows=query_rows, compiled=compiled)


def loss_decay(block_size: int, gamma: float) -> torch.Tensor:
    """[b] weight of each block position: 0 for the anchor, exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    decay = torch.exp(-(k - 1) / gamma)
    decay[0] = 0.0
    return decay


def dpace_weights(ce: torch.Tensor, scored: torch.Tensor, alpha: float) -> torch.Tensor:
    """`[n_blocks, b]` D-PACE weights (D-PACE, arXiv 2605.18810, Eq. 7 and 8; as SpecForge computes them,
    `specforge/algorithms/common/dflash_family_model.py` `_dpace_weight` at a6b6b023) from each block
    position's cross entropy `ce` and whether it is `scored` (both `[n_blocks, b]`): the drafter's
    confidence q = exp(-ce), smoothed q~ = (1 - alpha) q + alpha (1 where not scored, a no-op in the
    products), P_m = q~_1 ... q~_m, and w_j = sum of P_m over the scored m >= j: position j's share of
    the block's expected accepted length. 0 where not scored; no gradient flows through them."""
    with torch.no_grad():
        smooth = torch.where(scored, (1.0 - alpha) * torch.exp(-ce.float()) + alpha, 1.0)
        prefix = torch.cumprod(smooth, dim=-1) * scored
        return prefix.flip(-1).cumsum(-1).flip(-1) * scored


def dpace_row_weights(ce: torch.Tensor, rows: torch.Tensor, n_rows: int, block_size: int,
                      alpha: float) -> torch.Tensor:
    """`dpace_weights` of scored rows: `ce[i]` is the cross entropy of block row `rows[i]` of `n_rows`
    (the blocks' rows one block after another, b each)."""
    grid = torch.zeros(n_rows, dtype=torch.float32, device=ce.device)
    grid[rows] = ce.detach().float()
    scored = torch.zeros(n_rows, dtype=torch.bool, device=ce.device)
    scored[rows] = True
    return dpace_weights(grid.view(-1, block_size), scored.view(-1, block_size), alpha).view(-1)[rows]


def build_block_attention_mask(context_doc: torch.Tensor, context_pos: torch.Tensor,
                               block_doc: torch.Tensor, block_anchor: torch.Tensor,
                               block_size: int, window: int | None = None) -> torch.Tensor:
    """[Q, T+Q] bool. A query of block j sees context tokens of its own document at positions
    strictly before anchor_j, and every token of its own block; nothing else. With a `window`
    (a sliding-window layer), only what `sliding_window_mask` also allows of that.

    context_doc/context_pos: [T]; block_doc/block_anchor: [n_blocks]."""
    n_blocks = block_anchor.numel()
    q_doc = block_doc.repeat_interleave(block_size)
    q_anchor = block_anchor.repeat_interleave(block_size)
    sees_context = (q_doc[:, None] == context_doc[None, :]) & (context_pos[None, :] < q_anchor[:, None])
    q_block = torch.arange(n_blocks, device=block_anchor.device).repeat_interleave(block_size)
    sees_block = q_block[:, None] == q_block[None, :]
    mask = torch.cat([sees_context, sees_block], dim=1)
    if window is None:
        return mask
    q_pos = q_anchor + torch.arange(block_size, device=block_anchor.device).repeat(n_blocks)
    return mask & sliding_window_mask(q_pos, torch.cat([context_pos.to(q_pos.device), q_pos]), window)


def build_block_batch(input_ids: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor,
                      position_ids: torch.Tensor, anchors: list[torch.Tensor], block_size: int,
                      mask_token_id: int, gamma: float) -> BlockBatch:
    """Blocks for packed documents: `input_ids`, `loss_mask`, `position_ids` are `[T]`,
    `cu_seqlens` `[B+1]`, `anchors[d]` the document-relative anchors of document d."""
    device = input_ids.device
    starts = cu_seqlens[:-1].to(torch.int64).cpu()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64).cpu()
    if len(anchors) != lengths.numel():
        raise ValueError(f"got anchors for {len(anchors)} documents, the batch has {lengths.numel()}")
    block_doc = torch.cat([torch.full((a.numel(),), d, dtype=torch.int64) for d, a in enumerate(anchors)]
                          + [torch.zeros(0, dtype=torch.int64)])
    block_anchor = torch.cat([a.to(torch.int64).cpu() for a in anchors] + [torch.zeros(0, dtype=torch.int64)])
    offsets = torch.arange(block_size, dtype=torch.int64)
    positions = block_anchor[:, None] + offsets[None, :]                     # [n_blocks, b]
    in_document = positions < lengths[block_doc][:, None]
    flat = torch.where(in_document, starts[block_doc][:, None] + positions, 0).to(device)
    labels = torch.where(in_document.to(device), input_ids[flat], 0)         # unshifted: anchor + k
    scored = in_document.to(device) & loss_mask[flat].to(torch.bool)
    weights = scored.to(torch.float32) * loss_decay(block_size, gamma).to(device)[None, :]

    block_input_ids = torch.full_like(labels, mask_token_id)
    block_input_ids[:, 0] = labels[:, 0]
    return BlockBatch(block_input_ids.reshape(-1), positions.reshape(-1).to(device), labels.reshape(-1),
                      weights.reshape(-1), document_ids(cu_seqlens).to(device), position_ids.to(device),
                      block_doc.to(device), block_anchor.to(device), block_size, cu_seqlens)


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                normalizer: float | torch.Tensor | None = None, weigh=None) -> torch.Tensor:
    """sum(w * ce) / sum(w), cross entropy in float32; 0 (with a graph) when nothing is scored.
    `normalizer` replaces sum(w) when a batch's loss is accumulated over several parts. With `weigh`
    (D-PACE: `dpace_row_weights`) the weights are `weigh(ce)`, detached, and still divided by sum(w)."""
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    total = weights.sum() if normalizer is None else torch.as_tensor(normalizer, dtype=weights.dtype)
    if weigh is not None:
        weights = weigh(ce.detach())
    return (weights * ce).sum() / total.clamp_min(1e-6)


@torch.no_grad()
def count_correct(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> tuple[int, int]:
    """(scored block positions whose argmax is the label, scored block positions)."""
    scored = weights > 0
    return int((logits.argmax(-1)[scored] == labels[scored]).sum()), int(scored.sum())


def tally_by_position(offsets: torch.Tensor, flags: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[block_size]` int64: per block position k, the rows whose offset is k and whose flag is set,
    on the rows' device without a host round trip (no boolean indexing, no bincount's maximum)."""
    return torch.zeros(block_size, dtype=torch.int64, device=offsets.device).index_add_(
        0, offsets, flags.to(torch.int64))


@torch.no_grad()
def correct_by_position(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                        block_offsets: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count_correct_by_position` as two `[block_size]` int64 tensors on the logits' device."""
    scored = weights > 0
    correct = (logits.argmax(-1) == labels) & scored
    return (tally_by_position(block_offsets, correct, block_size),
            tally_by_position(block_offsets, scored, block_size))


def count_correct_by_position(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                              block_offsets: torch.Tensor, block_size: int) -> tuple[list[int], list[int]]:
    """Per block position k (0..b-1, `block_offsets` giving each row's k): (scored rows whose argmax
    is the label, scored rows). Position 0, the anchor, is never scored."""
    hits, counts = correct_by_position(logits, labels, weights, block_offsets, block_size)
    return hits.tolist(), counts.tolist()


def block_accuracy(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> float:
    """Fraction of scored block positions whose argmax is the label (nan when none is scored)."""
    correct, scored = count_correct(logits, labels, weights)
    return correct / scored if scored else math.nan


def head_in_compute_dtype(weight: torch.Tensor, device_type: str) -> torch.Tensor:
    """The frozen head's weight in the dtype its matmul runs in: the autocast dtype when autocast is on
    (one cast for all chunks, where autocast would cast per chunk), else its own."""
    compute = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
               else weight.dtype)
    return weight.to(compute)


def _chunk_log_probs(hidden_rows: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """`[rows, vocab]` float32 log-probabilities of a chunk of rows through `head` (in its dtype), as
    cross_entropy(logits.float()) computes them, without a float32 copy of the logits first."""
    logits = F.linear(hidden_rows.to(head.dtype), head)
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32)


# A chunk's loss over its logits (pluggable: `_ChunkedHeadLoss` runs whichever it is given):
# `chunk_loss(logits [rows, vocab], labels [rows], scale [rows] float32 or None) -> (row_losses, grad)`,
# row_losses `[rows]` float32 unweighted, grad the gradient of sum(scale * row_losses) with respect to the
# logits in their dtype (it may be written over `logits`, which the caller no longer reads), None when
# `scale` is None (no gradient wanted). The caller weighs, sums and normalises the row losses.
ChunkLoss = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"],
                     "tuple[torch.Tensor, torch.Tensor | None]"]


def softmax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor | None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The cross entropy of each row in float32 and its gradient (softmax - one-hot) * scale, rounded
    once to the logits' dtype and written over them (a `ChunkLoss`): the reference every device runs,
    what `dflash_loss` computes unchunked."""
    log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    row_losses = -log_probs.gather(1, labels[:, None]).squeeze(1)
    if scale is None:
        return row_losses, None
    probs = log_probs.exp_()  # in place: the softmax
    probs[torch.arange(labels.numel(), device=labels.device), labels] -= 1.0
    return row_losses, torch.mul(probs, scale[:, None], out=logits)


def _one_pass_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`softmax_cross_entropy`'s row losses, its gradient written over `logits`: under torch.compile a
    reduction over each row of the logits (their log-sum-exp) and one pass that reads them again and
    writes the gradient in their dtype; no float32 `[rows, vocab]` tensor exists."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    row_losses = lse - x.gather(1, labels[:, None]).squeeze(1)
    one_hot = torch.arange(x.shape[1], device=x.device)[None, :] == labels[:, None]
    logits.copy_((torch.exp(x - lse[:, None]) - one_hot.to(x.dtype)) * scale[:, None])
    return row_losses


def _one_pass_row_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    x = logits.float()
    return torch.logsumexp(x, dim=-1) - x.gather(1, labels[:, None]).squeeze(1)


_COMPILED_LOSS: dict[str, Callable] = {}


def fused_softmax_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor | None
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`softmax_cross_entropy` under torch.compile (rows dynamic: one compilation for every chunk),
    what training runs on CUDA: equal to the reference within float32 rounding (log-sum-exp, not
    log_softmax), the gradient in the logits' dtype, written over them."""
    if not _COMPILED_LOSS:
        _COMPILED_LOSS["grad"] = compile_rows_dynamic(_one_pass_cross_entropy)
        _COMPILED_LOSS["loss"] = compile_rows_dynamic(_one_pass_row_losses)
    if scale is None:
        return _COMPILED_LOSS["loss"](logits, labels), None
    return _COMPILED_LOSS["grad"](logits, labels, scale), logits


def cross_entropy_chunk_loss(compiled: bool) -> ChunkLoss:
    """The head's cross entropy: one pass under torch.compile, or the reference as written."""
    return fused_softmax_cross_entropy if compiled else softmax_cross_entropy


class _ChunkedHeadLoss(torch.autograd.Function):
    """sum(w * ce) / normalizer over the scored rows, with the frozen lm_head applied `chunk_size`
    rows at a time. Each chunk's gradient with respect to `hidden` is computed while its logits
    exist (`chunk_loss` writes the logits' gradient over them, weighted, then through the head), and
    the logits are freed: no `[rows, vocab]` tensor outlives its chunk, and backward only scales the
    stored `[rows, H]` gradient, so the head runs twice per row as in the unchunked path, not three
    times as recomputation would. Under autocast the head and its gradient run in the autocast dtype
    and the cross entropy in float32, as `F.linear` and `dflash_loss` do unchunked. With `weigh`
    (D-PACE) the rows' weights depend on their cross entropies: each chunk keeps its rows' unscaled
    gradient, and all rows are scaled by `weigh(ce)` once every chunk is done."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, offsets, normalizer, chunk_size, block_size, weigh,
                chunk_loss):
        needs_grad = ctx.needs_input_grad[0]
        device_type = hidden.device.type
        head = head_in_compute_dtype(weight, device_type)
        scale = weights / normalizer if weigh is None else torch.ones_like(weights)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        hits = torch.zeros(block_size, dtype=torch.int64, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        ce_rows = None if weigh is None else torch.empty(hidden.shape[0], dtype=torch.float32,
                                                         device=hidden.device)
        with torch.autocast(device_type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                logits = F.linear(hidden[rows].to(head.dtype), head)
                label = labels[rows]
                # Read before the chunk loss may write the gradient over them.
                correct = (logits.argmax(-1) == label) & (weights[rows] > 0)
                hits += tally_by_position(offsets[rows], correct, block_size)
                # (softmax - one-hot) * w / normalizer in the head's dtype (with `weigh`: unscaled,
                # scaled below), as the unchunked backward rounds its float32 gradient into the head.
                row_losses, grad_logits = chunk_loss(logits, label, scale[rows] if needs_grad else None)
                del logits
                if ce_rows is None:
                    loss += (weights[rows] * row_losses).sum()
                else:
                    ce_rows[rows] = row_losses
                if needs_grad:
                    grad_hidden[rows] = (grad_logits @ head).to(hidden.dtype)
                del grad_logits
        if ce_rows is not None:
            row_weights = weigh(ce_rows)
            loss = (row_weights * ce_rows).sum()
            if needs_grad:
                grad_hidden.mul_((row_weights / normalizer).to(grad_hidden.dtype)[:, None])
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(hits)
        return loss / normalizer, hits

    @staticmethod
    def backward(ctx, grad_loss, grad_hits):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), *([None] * 9)


@torch.no_grad()
def chunked_head_eval(hidden: torch.Tensor, lm_head: torch.nn.Linear, labels: torch.Tensor,
                      weights: torch.Tensor, chunk_size: int | None) -> tuple[float, torch.Tensor]:
    """sum(w * ce) and the argmax of every row of `hidden` `[N, H]` through the frozen `lm_head`, without
    gradient, `chunk_size` rows at a time (all at once when None): the training head's bound and dtypes
    (the head in the autocast dtype when autocast is on, the log-softmax in float32) for an evaluation,
    so no `[N, vocab]` tensor exists."""
    device_type = hidden.device.type
    head = head_in_compute_dtype(lm_head.weight, device_type)
    argmax = torch.empty(hidden.shape[0], dtype=torch.int64, device=hidden.device)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    step = max(1, chunk_size or hidden.shape[0])
    with torch.autocast(device_type, enabled=False):
        for start in range(0, hidden.shape[0], step):
            rows = slice(start, start + step)
            log_probs = _chunk_log_probs(hidden[rows], head)
            argmax[rows] = log_probs.argmax(-1)
            total -= (weights[rows] * log_probs.gather(1, labels[rows, None]).squeeze(1)).sum()
            del log_probs
    return float(total), argmax


def chunked_head_loss(hidden: torch.Tensor, lm_head: torch.nn.Linear, labels: torch.Tensor,
                      weights: torch.Tensor, offsets: torch.Tensor, block_size: int, chunk_size: int,
                      normalizer: float | torch.Tensor | None = None, weigh=None,
                      chunk_loss: ChunkLoss = softmax_cross_entropy
                      ) -> tuple[torch.Tensor, list[int], list[int]]:
    """`dflash_loss(lm_head(hidden), labels, weights, normalizer, weigh)` over rows `[N, H]`, the head
    applied `chunk_size` rows at a time (`_ChunkedHeadLoss`), with what `count_correct_by_position`
    gives from the same chunks: per block position k (`offsets` giving each row's k), the scored
    rows whose argmax is the label and the scored rows. The head must be frozen."""
    loss, hits, counts = chunked_head_loss_on_device(hidden, lm_head, labels, weights, offsets, block_size,
                                                     chunk_size, normalizer, weigh, chunk_loss)
    return loss, hits.tolist(), counts.tolist()


def chunked_head_loss_on_device(hidden: torch.Tensor, lm_head: torch.nn.Linear, labels: torch.Tensor,
                                weights: torch.Tensor, offsets: torch.Tensor, block_size: int,
                                chunk_size: int, normalizer: float | torch.Tensor | None = None, weigh=None,
                                chunk_loss: ChunkLoss = softmax_cross_entropy
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunked_head_loss` with its counts left as `[block_size]` tensors on the device (no host sync)."""
    if lm_head.weight.requires_grad or lm_head.bias is not None:
        raise ValueError("chunked_head_loss needs a frozen lm_head without bias")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    total = weights.sum() if normalizer is None else torch.as_tensor(normalizer, dtype=weights.dtype)
    total = total.to(weights.device).clamp_min(1e-6)
    loss, hits = _ChunkedHeadLoss.apply(hidden, lm_head.weight, labels, weights.float(), offsets, total,
                                        chunk_size, block_size, weigh, chunk_loss)
    return loss, hits, tally_by_position(offsets, weights > 0, block_size)
