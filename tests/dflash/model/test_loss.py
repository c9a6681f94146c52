"""Anchors, labels, weights and the block mask: pins the two bugs public trainers shipped
(shifted labels; `<=` instead of `<` in the anchor mask)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_ops.core.config import default_gamma
from dflash_ops.model.loss import (
    block_accuracy,
    build_block_attention_mask,
    build_block_batch,
    count_correct_by_position,
    dflash_loss,
    loss_decay,
    sample_anchors,
)
from dflash_ops.training.trainer import lr_multiplier

MASK = 99
BLOCK = 4


def two_documents():
    """Packed docs of lengths 10 and 7; ids are unique so every label names its position."""
    input_ids = torch.arange(10, 27)
    loss_mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 0, 1] + [0, 1, 1, 1, 1, 1, 1])
    cu_seqlens = torch.tensor([0, 10, 17], dtype=torch.int32)
    position_ids = torch.tensor(list(range(10)) + list(range(7)))
    anchors = [torch.tensor([3, 5, 8]), torch.tensor([1, 4])]
    return input_ids, loss_mask, cu_seqlens, position_ids, anchors


def test_labels_are_the_tokens_at_anchor_plus_k_unshifted():
    input_ids, loss_mask, cu, pos, anchors = two_documents()
    batch = build_block_batch(input_ids, loss_mask, cu, pos, anchors, BLOCK, MASK, gamma=2.0)
    starts = [0, 10]
    lengths = [10, 7]
    row = 0
    for doc, doc_anchors in enumerate(anchors):
        for a in doc_anchors.tolist():
            for k in range(BLOCK):
                q = row * BLOCK + k
                assert batch.block_positions[q] == a + k
                if a + k < lengths[doc]:
                    assert batch.labels[q] == input_ids[starts[doc] + a + k]     # not a + k + 1
                expected_input = input_ids[starts[doc] + a] if k == 0 else MASK
                assert batch.block_input_ids[q] == expected_input
            row += 1


def test_weights_skip_the_anchor_and_decay_as_exp_minus_k_minus_1_over_gamma():
    input_ids, loss_mask, cu, pos, anchors = two_documents()
    gamma = 2.0
    batch = build_block_batch(input_ids, loss_mask, cu, pos, anchors, BLOCK, MASK, gamma=gamma)
    weights = batch.weights.view(-1, BLOCK)
    assert torch.all(weights[:, 0] == 0)
    # Block (doc 0, anchor 3): positions 3..6 all in the response.
    expected = [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, BLOCK)]
    assert weights[0].tolist() == pytest.approx(expected)
    # Block (doc 0, anchor 5): position 8 has loss_mask 0 -> unscored.
    assert weights[1].tolist() == pytest.approx([0.0, expected[1], expected[2], 0.0])
    # Block (doc 0, anchor 8): position 10, 11 fall past the document's end -> unscored.
    assert weights[2].tolist() == pytest.approx([0.0, expected[1], 0.0, 0.0])
    # Block (doc 1, anchor 4): positions 4..7, 7 is past the end.
    assert weights[4].tolist() == pytest.approx([0.0, expected[1], expected[2], 0.0])


def test_mask_sees_context_strictly_before_the_anchor_and_only_its_own_block():
    input_ids, loss_mask, cu, pos, anchors = two_documents()
    batch = build_block_batch(input_ids, loss_mask, cu, pos, anchors, BLOCK, MASK, gamma=2.0)
    n_ctx = 17
    mask = batch.attention_mask
    assert mask.shape == (5 * BLOCK, n_ctx + 5 * BLOCK)
    blocks = [(0, 3), (0, 5), (0, 8), (1, 1), (1, 4)]
    doc_of_ctx = [0] * 10 + [1] * 7
    for j, (doc, anchor) in enumerate(blocks):
        for q in range(j * BLOCK, (j + 1) * BLOCK):
            seen_ctx = [t for t in range(n_ctx) if mask[q, t]]
            assert seen_ctx == [t for t in range(n_ctx) if doc_of_ctx[t] == doc and pos[t] < anchor]
            assert not mask[q, (0 if doc == 0 else 10) + anchor]                     # `<`, not `<=`
            seen_blocks = [t - n_ctx for t in range(n_ctx, mask.shape[1]) if mask[q, t]]
            assert seen_blocks == list(range(j * BLOCK, (j + 1) * BLOCK))            # bidirectional


def test_attention_mask_never_crosses_documents():
    ctx_doc = torch.tensor([0, 0, 0, 1, 1, 1])
    ctx_pos = torch.tensor([0, 1, 2, 0, 1, 2])
    mask = build_block_attention_mask(ctx_doc, ctx_pos, torch.tensor([1]), torch.tensor([3]), block_size=2)
    assert mask[:, :6].tolist() == [[False, False, False, True, True, True]] * 2


def test_sample_anchors_respects_loss_mask_and_block_end():
    loss_mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1])
    generator = torch.Generator().manual_seed(0)
    all_anchors = sample_anchors(loss_mask, BLOCK, max_anchors=100, generator=generator)
    assert all_anchors.tolist() == [2, 3, 6, 7, 8]  # a+1 in the response, a <= 12 - 4
    some = sample_anchors(loss_mask, BLOCK, max_anchors=3, generator=generator)
    assert len(some) == 3 and set(some.tolist()) <= set(all_anchors.tolist())
    assert some.tolist() == sorted(set(some.tolist()))
    assert sample_anchors(torch.ones(3), BLOCK, 10).numel() == 0


def test_dflash_loss_is_the_weighted_mean_of_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 11, generator=g)
    labels = torch.randint(0, 11, (8,), generator=g)
    weights = torch.tensor([0, 1, 0.5, 0.25, 0, 1, 0.5, 0.25])
    ce = F.cross_entropy(logits, labels, reduction="none")
    loss = dflash_loss(logits, labels, weights).item()
    assert loss == pytest.approx(float((ce * weights).sum() / weights.sum()))
    # An unscored position does not move the loss, whatever its logits.
    changed = logits.clone()
    changed[0] += 100 * torch.randn(11, generator=g)
    assert dflash_loss(changed, labels, weights).item() == pytest.approx(loss)


def test_block_accuracy_counts_scored_positions_only():
    logits = torch.eye(4) * 5
    labels = torch.tensor([0, 1, 3, 0])
    assert block_accuracy(logits, labels, torch.tensor([1.0, 1.0, 1.0, 0.0])) == pytest.approx(2 / 3)
    assert math.isnan(block_accuracy(logits, labels, torch.zeros(4)))


def test_gamma_defaults_and_decay():
    assert [default_gamma(b) for b in (16, 10, 8, 4)] == [7.0, 5.0, 4.0, 1.0]
    decay = loss_decay(16, 7.0)
    assert decay[0] == 0 and decay[1] == 1
    assert decay[15].item() == pytest.approx(math.exp(-14 / 7))


def test_lr_warms_up_then_decays_to_zero():
    values = [lr_multiplier(s, warmup_steps=4, total_steps=20) for s in range(21)]
    assert values[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert values[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[4:], values[5:], strict=False))
    assert values[20] == pytest.approx(0.0)


def test_correct_predictions_are_counted_per_block_position():
    labels = torch.tensor([1, 2, 3, 1, 2, 3])
    offsets = torch.tensor([1, 2, 3, 1, 2, 3])          # each row's position in its block
    weights = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0])  # the last row is not scored
    logits = F.one_hot(torch.tensor([1, 0, 3, 1, 2, 0]), 4).float()
    hits, counts = count_correct_by_position(logits, labels, weights, offsets, block_size=4)
    assert hits == [0, 2, 1, 1] and counts == [0, 2, 2, 1]
