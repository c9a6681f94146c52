"""Training against the target's own distribution: `loss.kind` ce, kl, tvd or a weighted mix of them.

What the target provides. Block position k (k >= 1) of an anchor a predicts the token at a + k; the
target's distribution of that token is softmax(lm_head(h[a + k - 1])), h the target's last hidden state
(after its final norm: transformers' `hidden_states[-1]`, which `dflash_ops.data.target._layer_capture`
already captures for the last layer id). So the target ranks capture one more layer, the last one, as
an extra H-wide column of the features they send (`capture_layer_ids`): the features become
`[T, (k+1)*H]`, the transport and the feature cache carry them unchanged, and the drafter rank splits
them (`split_features`) and applies the lm_head it already holds (the target's, frozen) to the rows it
needs. Bytes per sample at the recipe (Qwen3-8B, H 4096, vocab 151936, 3072 tokens, bf16):
  - the 5 feature layers already sent:       3072 * 5 * 4096 * 2 = 125.8 MB
  - the last hidden state (chosen):          3072 * 4096 * 2     =  25.2 MB (+20 %), exact
  - the full logits:                         3072 * 151936 * 2   = 933.5 MB (x7.4 the features)
  - top-k logits (value bf16 + index int32): 3072 * k * 6        =   1.2 MB at k = 64, but the rest of
    the vocabulary's mass is unknown, so KL and TVD against it are not the target's; and the target
    rank would run its 151936-wide head over every token (1.2 TFLOP a sample) where the drafter rank
    runs it only over the scored block rows it reads.
The last hidden state is exact at +20 % of the bytes; its head costs the drafter rank one more
`[rows, H] x [H, vocab]` matmul per scored row, the same as its own logits.

Where a block position's target distribution comes from (`target_rows`): the target's position
a + k - 1 of the block's own document. It is never an input of the drafter (the drafter reads the first
k*H columns only); it is a function of the tokens at positions <= a + k - 1, which are the context
(< a) and the labels of the block's positions 0..k-1: the loss of position k sees nothing the hard
labels of its own and earlier positions do not already give, never the token a + k or later, never
another document of a packed batch (tests/dflash/model/test_distill.py).

The losses, per scored row, with q = softmax(drafter logits), p = softmax(target logits), both float32:
  ce  = -log q[label]                 (the hard label: the token the target generated)
  kl  = sum_v p_v (log p_v - log q_v)  (forward KL, target to drafter)
  tvd = sum_v |p_v - q_v|             (Model-Optimizer's "l1"/TVD term, `_tvd_per_token` in
                                       modelopt/torch/speculative/plugins/hf_dspark.py at 8265768:
                                       the L1 distance, twice the total-variation distance)
mixed as sum_term weight_term * term, then weighted per row (DFlash's decay, or D-PACE's weights,
which stay computed from the row's cross entropy: the drafter's confidence in the label) and divided by
the normalizer, as `dflash_ops.model.loss.dflash_loss` does for ce alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_ops.core.loss_section import (  # noqa: F401 (re-exported)
    LOSS_KINDS,
    LOSS_TERMS,
    capture_layer_ids,
    loss_mix,
    needs_target,
)
from dflash_ops.model.loss import BlockBatch, head_in_compute_dtype, tally_by_position


def split_features(features: torch.Tensor, hidden_size: int, n_features: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The `[T, k*H]` drafter features and the `[T, H]` target last hidden state of `[T, (k+1)*H]`
    features; features of k layers as they are, and None."""
    width = features.shape[1]
    if width == n_features * hidden_size:
        return features, None
    if width != (n_features + 1) * hidden_size:
        raise ValueError(f"features of width {width} hold neither {n_features} nor {n_features + 1} "
                         f"layers of {hidden_size}")
    return features[:, : n_features * hidden_size], features[:, n_features * hidden_size:]


def target_rows(batch: BlockBatch) -> torch.Tensor:
    """`[Q]` int64: for each block row (block j, position k), the context row whose target output
    predicts that row's label: position anchor_j + k - 1 of block j's document (k = 0, never scored,
    points at the anchor itself; rows past the document's end, never scored, at its last token)."""
    b = batch.block_size
    starts = batch.cu_seqlens.to(batch.block_anchor.device, torch.int64)
    lengths = starts[1:] - starts[:-1]
    k = torch.arange(b, device=batch.block_anchor.device)
    position = batch.block_anchor[:, None] + (k - 1).clamp_min(0)[None, :]
    position = torch.minimum(position, (lengths[batch.block_doc] - 1)[:, None])
    return (starts[:-1][batch.block_doc][:, None] + position).reshape(-1)


def mix_chunk(logits: torch.Tensor, labels: torch.Tensor, target_logits: torch.Tensor | None,
              mix: dict[str, float], want_grad: bool
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(ce `[rows]`, mixed loss `[rows]`, d mixed / d logits `[rows, vocab]` float32 or None) of a chunk,
    all in float32 from logits in any dtype. The gradients, written out: ce: q - onehot; kl: q - p;
    tvd: q * (s - sum_v s_v q_v) with s = sign(q - p) (torch's abs gradient, 0 where q = p)."""
    log_q = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    ce = -log_q.gather(1, labels[:, None]).squeeze(1)
    q = log_q.exp()
    mixed = torch.zeros_like(ce)
    grad = torch.zeros_like(q) if want_grad else None
    log_p = None if target_logits is None else torch.log_softmax(target_logits, dim=-1, dtype=torch.float32)
    for term, weight in mix.items():
        if term == "ce":
            mixed += weight * ce
            if want_grad:
                grad += weight * q
                grad[torch.arange(labels.numel(), device=labels.device), labels] -= weight
            continue
        if log_p is None:
            raise ValueError(f"loss term {term} needs the target's distribution, and none was given")
        p = log_p.exp()
        if term == "kl":
            mixed += weight * (p * (log_p - log_q)).sum(-1)
            if want_grad:
                grad += weight * (q - p)
        elif term == "tvd":
            diff = q - p
            mixed += weight * diff.abs().sum(-1)
            if want_grad:
                s = diff.sign()
                grad += weight * q * (s - (s * q).sum(-1, keepdim=True))
        else:
            raise ValueError(f"loss term {term!r}: a DFlash drafter trains ce, kl and tvd")
    return ce, mixed, grad


class _ChunkedMixLoss(torch.autograd.Function):
    """sum(w * mixed) / normalizer over the scored rows, the frozen head applied `chunk_size` rows at a
    time to the drafter's rows and to the target's last hidden rows: `_ChunkedHeadLoss`'s scheme
    (`dflash_ops.model.loss`) for the mix: each chunk's gradient with respect to `hidden` is computed
    while its logits exist, and with `weigh` (D-PACE, from each row's cross entropy) scaled once every
    chunk is done."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, target_hidden, weights, offsets, normalizer, chunk_size,
                block_size, weigh, mix):
        needs_grad = ctx.needs_input_grad[0]
        device_type = hidden.device.type
        head = head_in_compute_dtype(weight, device_type)
        hits = torch.zeros(block_size, dtype=torch.int64, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if needs_grad else None
        ce_rows = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        mixed_rows = torch.empty_like(ce_rows)
        with torch.autocast(device_type, enabled=False):
            for start in range(0, hidden.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                logits = F.linear(hidden[rows].to(head.dtype), head)
                target_logits = (None if target_hidden is None
                                 else F.linear(target_hidden[rows].to(head.dtype), head))
                label = labels[rows]
                correct = (logits.argmax(-1) == label) & (weights[rows] > 0)
                hits += tally_by_position(offsets[rows], correct, block_size)
                ce_rows[rows], mixed_rows[rows], grad_logits = mix_chunk(logits, label, target_logits, mix,
                                                                         needs_grad)
                del logits, target_logits
                if needs_grad:
                    scale = weights[rows] / normalizer if weigh is None else torch.ones_like(weights[rows])
                    grad_logits = (grad_logits * scale[:, None]).to(head.dtype)
                    grad_hidden[rows] = (grad_logits @ head).to(hidden.dtype)
                del grad_logits
        row_weights = weights if weigh is None else weigh(ce_rows)
        loss = (row_weights * mixed_rows).sum()
        if needs_grad and weigh is not None:
            grad_hidden.mul_((row_weights / normalizer).to(grad_hidden.dtype)[:, None])
        ctx.save_for_backward(grad_hidden)
        ctx.mark_non_differentiable(hits)
        return loss / normalizer, hits

    @staticmethod
    def backward(ctx, grad_loss, grad_hits):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), *([None] * 10)


def mix_head_loss(hidden: torch.Tensor, lm_head: torch.nn.Linear, labels: torch.Tensor,
                  target_hidden: torch.Tensor | None, weights: torch.Tensor, offsets: torch.Tensor,
                  block_size: int, chunk_size: int | None, mix: dict[str, float],
                  normalizer: float | torch.Tensor | None = None, weigh=None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mixed loss of scored rows `hidden` `[N, H]` (labels `[N]`, the target's last hidden state of
    each row's predecessor `target_hidden` `[N, H]`, None for ce alone) through the frozen `lm_head`,
    `chunk_size` rows at a time (all at once when None), and per block position the scored rows whose
    argmax is the label and the scored rows (`[block_size]` tensors on the device)."""
    if lm_head.weight.requires_grad or lm_head.bias is not None:
        raise ValueError("mix_head_loss needs a frozen lm_head without bias")
    total = weights.sum() if normalizer is None else torch.as_tensor(normalizer, dtype=weights.dtype)
    total = total.to(weights.device).clamp_min(1e-6)
    step = max(1, chunk_size or hidden.shape[0])
    loss, hits = _ChunkedMixLoss.apply(hidden, lm_head.weight, labels, target_hidden, weights.float(),
                                       offsets, total, step, block_size, weigh, mix)
    return loss, hits, tally_by_position(offsets, weights > 0, block_size)


def scored_mix_loss(drafter, hidden: torch.Tensor, batch: BlockBatch, target_last: torch.Tensor | None,
                    normalizer: float | torch.Tensor, chunk_size: int | None, mix: dict[str, float],
                    dpace_alpha: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`dflash_ops.training.trainer.scored_loss` for a mix: a group's share of the batch loss from the
    drafter's hidden states `[Q, H]` and the group's target last hidden states `[T, H]` (the extra
    column of its features), read at `target_rows`."""
    from dflash_ops.model.loss import dpace_row_weights

    block_size = drafter.cfg.block_size
    rows = batch.scored_rows
    labels, weights = batch.labels[rows], batch.weights[rows]
    offsets = rows % block_size
    weigh = None
    if dpace_alpha is not None:
        def weigh(ce):
            return dpace_row_weights(ce, rows, batch.weights.numel(), block_size, dpace_alpha)
    target_hidden = None if target_last is None else target_last[target_rows(batch)[rows]]
    return mix_head_loss(hidden[rows], drafter.lm_head, labels, target_hidden, weights, offsets, block_size,
                         chunk_size, mix, normalizer, weigh)
