"""`loss.kind` ce, kl, tvd and mixes (dflash_ops.model.distill): each loss and its gradient against a dense
reference written with autograd, chunked or not, under DFlash's decay and D-PACE; where each block position's
target distribution comes from, and that nothing else reaches it (no leak across positions or documents)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_ops.model.distill import (
    capture_layer_ids,
    loss_mix,
    mix_chunk,
    mix_head_loss,
    split_features,
    target_rows,
)
from dflash_ops.model.loss import build_block_batch, dpace_weights

MIXES = [("ce", None), ("kl", None), ("tvd", None), ("mix", {"ce": 0.1, "tvd": 0.9}),
         ("mix", {"ce": 0.3, "kl": 0.5, "tvd": 0.2})]


def dense_reference(hidden, head, labels, target_hidden, weights, mix, block_rows=None, block_size=None,
                    alpha=None):
    """The loss as the formulas say, on the full `[N, vocab]` logits, autograd for the gradient."""
    logits = hidden @ head.T
    log_q = torch.log_softmax(logits.double(), -1)
    p = torch.softmax((target_hidden @ head.T).double(), -1)
    terms = {"ce": F.nll_loss(log_q, labels, reduction="none"),
             "kl": F.kl_div(log_q, p, reduction="none").sum(-1),
             "tvd": (log_q.exp() - p).abs().sum(-1)}
    mixed = sum(w * terms[t] for t, w in mix.items())
    if alpha is not None:  # D-PACE from the drafter's cross entropies, one block after another
        n = block_rows.max().item() // block_size * block_size + block_size
        ce = torch.zeros(n, dtype=torch.float64)
        ce[block_rows] = terms["ce"].detach()
        scored = torch.zeros(n, dtype=torch.bool)
        scored[block_rows] = True
        grid = dpace_weights(ce.view(-1, block_size), scored.view(-1, block_size), alpha)
        row_w = grid.view(-1)[block_rows]
        return (row_w.double() * mixed).sum() / weights.double().sum()
    return (weights.double() * mixed).sum() / weights.double().sum()


def _case(seed=0, n=23, hidden_size=12, vocab=41):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden_size, vocab, bias=False).requires_grad_(False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden_size, generator=g))
    hidden = torch.randn(n, hidden_size, generator=g, dtype=torch.float64).float()
    target_hidden = torch.randn(n, hidden_size, generator=g)
    labels = torch.randint(vocab, (n,), generator=g)
    weights = torch.rand(n, generator=g) + 0.1
    return head, hidden, target_hidden, labels, weights


@pytest.mark.parametrize("kind,weights", MIXES)
@pytest.mark.parametrize("chunk_size", [None, 1, 5])
def test_each_loss_and_its_gradient_equal_the_dense_reference(kind, weights, chunk_size):
    mix = loss_mix(kind, weights)
    head, hidden, target_hidden, labels, row_weights = _case()
    offsets = torch.arange(hidden.shape[0]) % 4
    leaf = hidden.clone().requires_grad_(True)
    loss, hits, counts = mix_head_loss(leaf, head, labels, target_hidden, row_weights, offsets, 4, chunk_size,
                                       mix)
    loss.backward()
    ref_leaf = hidden.double().clone().requires_grad_(True)
    ref = dense_reference(ref_leaf, head.weight.double(), labels, target_hidden.double(), row_weights, mix)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, rtol=1e-4, atol=1e-6)
    assert counts.sum().item() == hidden.shape[0]
    argmax = (hidden @ head.weight.T).argmax(-1)
    assert hits.sum().item() == int((argmax == labels).sum())


@pytest.mark.parametrize("kind,weights", MIXES)
def test_dpace_weights_still_apply_and_come_from_the_cross_entropy(kind, weights):
    from dflash_ops.model.loss import dpace_row_weights

    mix = loss_mix(kind, weights)
    block_size = 4
    head, hidden, target_hidden, labels, _ = _case(seed=1, n=18)
    rows = torch.tensor([r for r in range(24) if r % block_size][:18])  # scored rows: never position 0
    marks = torch.ones(18)
    leaf = hidden.clone().requires_grad_(True)

    def weigh(ce):
        return dpace_row_weights(ce, rows, 24, block_size, 0.5)

    loss, _, _ = mix_head_loss(leaf, head, labels, target_hidden, marks, rows % block_size, block_size, 5,
                               mix, weigh=weigh)
    loss.backward()
    ref_leaf = hidden.double().clone().requires_grad_(True)
    ref = dense_reference(ref_leaf, head.weight.double(), labels, target_hidden.double(), marks, mix, rows,
                          block_size, 0.5)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad.double(), ref_leaf.grad, rtol=1e-4, atol=1e-6)


def test_ce_alone_is_the_trainers_cross_entropy_and_needs_no_target():
    from dflash_ops.model.loss import dflash_loss

    head, hidden, _, labels, weights = _case(seed=2)
    offsets = torch.zeros_like(labels)
    loss, _, _ = mix_head_loss(hidden, head, labels, None, weights, offsets, 1, 7, {"ce": 1.0})
    torch.testing.assert_close(loss, dflash_loss(hidden @ head.weight.T, labels, weights))
    with pytest.raises(ValueError, match="needs the target"):
        mix_chunk(hidden @ head.weight.T, labels, None, {"tvd": 1.0}, want_grad=False)


def test_a_drafter_equal_to_the_target_has_no_kl_or_tvd():
    head, _, target_hidden, labels, weights = _case(seed=3)
    logits = target_hidden @ head.weight.T
    _, mixed, grad = mix_chunk(logits, labels, logits, {"kl": 1.0, "tvd": 1.0}, want_grad=True)
    torch.testing.assert_close(mixed, torch.zeros_like(mixed), rtol=0, atol=1e-6)
    torch.testing.assert_close(grad, torch.zeros_like(grad), rtol=0, atol=1e-6)


def test_the_kinds_and_their_weights_are_checked():
    assert loss_mix("ce") == {"ce": 1.0}
    assert loss_mix("mix", {"ce": 0.1, "tvd": 0.9}) == {"ce": 0.1, "tvd": 0.9}
    for kind, weights in [("hinge", None), ("mix", None), ("mix", {"jsd": 1.0}), ("mix", {"ce": -1.0}),
                          ("mix", {"ce": 0.0}), ("kl", {"kl": 1.0})]:
        with pytest.raises(ValueError):
            loss_mix(kind, weights)


def test_the_target_captures_its_last_layer_only_when_the_loss_needs_it():
    assert capture_layer_ids([1, 9, 17, 25, 33], 36, {"ce": 1.0}) == [1, 9, 17, 25, 33]
    assert capture_layer_ids([1, 9, 17, 25, 33], 36, {"ce": 0.1, "tvd": 0.9}) == [1, 9, 17, 25, 33, 35]
    features = torch.arange(3 * 4 * 6).view(3, 24)  # H = 6, k = 3 plus the last hidden state
    drafter_part, last = split_features(features, 6, 3)
    assert torch.equal(drafter_part, features[:, :18]) and torch.equal(last, features[:, 18:])
    same, none = split_features(features[:, :18], 6, 3)
    assert none is None and torch.equal(same, features[:, :18])
    with pytest.raises(ValueError, match="neither"):
        split_features(features[:, :20], 6, 3)


def _packed_batch(block_size=4):
    """Two documents packed (lengths 11 and 9), all response, anchors chosen by hand."""
    lengths = [11, 9]
    input_ids = torch.arange(20) % 13 + 1
    loss_mask = torch.ones(20, dtype=torch.int64)
    cu_seqlens = torch.tensor([0, 11, 20], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    anchors = [torch.tensor([0, 3, 7]), torch.tensor([2, 5])]
    return build_block_batch(input_ids, loss_mask, cu_seqlens, position_ids, anchors, block_size,
                             mask_token_id=0, gamma=7.0), cu_seqlens


def test_each_block_position_reads_the_target_at_anchor_plus_k_minus_1_of_its_own_document():
    batch, cu = _packed_batch()
    source = target_rows(batch).view(-1, 4)
    for j in range(batch.block_anchor.numel()):
        doc, anchor = int(batch.block_doc[j]), int(batch.block_anchor[j])
        start, end = int(cu[doc]), int(cu[doc + 1])
        for k in range(1, 4):
            if batch.weights[j * 4 + k] > 0:
                assert int(source[j, k]) == start + anchor + k - 1
                assert start <= int(source[j, k]) < end


def test_no_block_position_receives_a_target_distribution_it_must_not_see():
    """Perturb the target's last hidden state at one packed position at a time: exactly the scored rows
    whose label that position's output predicts change their loss. That position is the label's
    predecessor in the same document: at or after the anchor (so not in the drafter's visible context,
    kv < anchor: it is never an input) and before the label (the target is causal: its output there
    depends on the tokens up to the label's predecessor, the labels of positions 0..k-1 and the
    context, never on the label itself or anything later), and never in another document."""
    g = torch.Generator().manual_seed(4)
    batch, cu = _packed_batch()
    vocab, hidden_size = 17, 8
    head = torch.randn(vocab, hidden_size, generator=g)
    rows = batch.scored_rows
    drafter_logits = torch.randn(rows.numel(), vocab, generator=g)
    target_last = torch.randn(20, hidden_size, generator=g)

    def row_losses(last):
        target_logits = last[target_rows(batch)[rows]] @ head.T
        return mix_chunk(drafter_logits, batch.labels[rows], target_logits, {"kl": 0.5, "tvd": 0.5}, False)[1]

    base = row_losses(target_last)
    doc_of = torch.repeat_interleave(torch.arange(2), torch.tensor([11, 9]))
    reached = {}
    for t in range(20):
        moved = target_last.clone()
        moved[t] += 1.0
        for i in (row_losses(moved) != base).nonzero().squeeze(1).tolist():
            assert i not in reached, "a row's distribution must come from one position"
            reached[i] = t
    assert sorted(reached) == list(range(rows.numel())), "every scored row reads the target"
    for i, t in reached.items():
        row = int(rows[i])
        j, k = divmod(row, 4)
        doc, anchor = int(batch.block_doc[j]), int(batch.block_anchor[j])
        assert int(doc_of[t]) == doc
        position = t - int(cu[doc])
        assert anchor <= position < anchor + k == int(batch.block_positions[row])
        assert position == anchor + k - 1
