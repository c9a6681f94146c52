"""DSpark (`model.kind: dspark`, dflash_ops.model.dspark): the Markov head as vLLM applies it, the rows'
alignment (labels one further than DFlash's, the teacher-forced previous token, the target's output one before
the label), no position reached by a distribution or a token it must not see, and the loss and its gradients
against a dense reference (CE x 0.1 + TVD x 0.9 + BCE against 1 - TVD/2, Model-Optimizer's mix)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dflash_ops.model.drafter import DrafterConfig
from dflash_ops.model.dspark import DSparkDrafter, dspark_loss, dspark_targets
from dflash_ops.model.loss import build_block_batch, dpace_row_weights

VOCAB, HIDDEN, RANK, B = 29, 16, 4, 4


def _drafter(confidence=True, seed=0):
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=HIDDEN, intermediate_size=32, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=8, num_layers=1, num_target_features=2, block_size=B,
                        mask_token_id=VOCAB - 1, vocab_size=VOCAB)
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    drafter = DSparkDrafter(cfg, embed, head, RANK, confidence_head=confidence)
    with torch.no_grad():  # a trained head, not the fresh zero one
        drafter.markov_head.markov_w2.weight.normal_()
    return drafter


def _packed(block_size=B):
    lengths = [11, 9]
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(VOCAB - 1, (20,), generator=g)
    loss_mask = torch.ones(20, dtype=torch.int64)
    loss_mask[11:13] = 0  # the second document's first two tokens are prompt
    cu_seqlens = torch.tensor([0, 11, 20], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    anchors = [torch.tensor([0, 3, 7]), torch.tensor([2, 5])]
    batch = build_block_batch(input_ids, loss_mask, cu_seqlens, position_ids, anchors, block_size, VOCAB - 1,
                              7.0)
    return batch, input_ids, loss_mask, cu_seqlens


def test_the_markov_head_adds_w2_times_w1_of_the_previous_token_as_vllm_does():
    drafter = _drafter()
    hidden = torch.randn(5, HIDDEN)
    prev = torch.tensor([3, 0, 7, 7, 28])
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    assert w1.shape == (VOCAB, RANK) and w2.shape == (VOCAB, RANK)  # vLLM: Embedding(V, r), LM head (V, r)
    expected = hidden @ drafter.lm_head.weight.T + (w2 @ w1[prev].T).T
    torch.testing.assert_close(drafter.corrected_logits(hidden, prev), expected)
    # The confidence head on [hidden ; markov_w1[prev]], float32, sigmoid (vLLM's compute_confidence).
    proj = drafter.confidence_head.proj
    assert proj.weight.dtype == torch.float32 and proj.weight.shape == (1, HIDDEN + RANK)
    assert proj.bias is not None
    vllm = torch.sigmoid(torch.cat([hidden, w1[prev]], -1) @ proj.weight.T + proj.bias)[:, 0]
    torch.testing.assert_close(drafter.confidence(hidden, prev), vllm)


def test_each_row_predicts_the_token_after_its_position_from_the_token_at_it():
    batch, input_ids, loss_mask, cu = _packed()
    t = dspark_targets(batch, input_ids, loss_mask, gamma=7.0)
    expected_rows = []
    for j in range(batch.block_anchor.numel()):
        doc, anchor = int(batch.block_doc[j]), int(batch.block_anchor[j])
        start, end = int(cu[doc]), int(cu[doc + 1])
        for k in range(B):
            label = start + anchor + k + 1
            if label < end and loss_mask[label]:
                expected_rows.append((j * B + k, int(input_ids[label]), int(input_ids[label - 1]), label - 1,
                                      math.exp(-k / 7.0)))
    assert [r for r, *_ in expected_rows] == t.rows.tolist()
    assert [lab for _, lab, *_ in expected_rows] == t.labels.tolist()
    assert [p for _, _, p, *_ in expected_rows] == t.prev_ids.tolist()
    assert [s for *_, s, _ in expected_rows] == t.target_rows.tolist()
    torch.testing.assert_close(t.weights, torch.tensor([w for *_, w in expected_rows]))
    assert 0 in (t.rows % B).tolist(), "position 0 drafts too (a block of b drafts)"


def test_no_row_is_reached_by_a_distribution_or_a_token_it_must_not_see():
    """Each row's label is at anchor + k + 1. Its target distribution (perturb the target's last hidden state
    at each packed position and see which rows move) and its teacher-forced previous token both come from
    anchor + k of its own document: after the context the drafter sees (kv < anchor), before the label."""
    batch, input_ids, loss_mask, cu = _packed()
    drafter = _drafter()
    t = dspark_targets(batch, input_ids, loss_mask, gamma=7.0)
    hidden = torch.randn(batch.block_input_ids.numel(), HIDDEN)
    last = torch.randn(20, HIDDEN)
    doc_of = torch.repeat_interleave(torch.arange(2), torch.tensor([11, 9]))

    def rows_loss(target_last):
        # One row at a time: its own loss (weight 1, normalizer 1).
        out = []
        for i in range(t.rows.numel()):
            one = type(t)(*(x[i:i + 1] for x in (t.rows, t.labels, t.prev_ids, t.weights, t.target_rows,
                                                  t.offsets)))
            out.append(dspark_loss(drafter, hidden, one, target_last, 1.0, {"tvd": 1.0, "bce": 1.0})[0])
        return torch.stack(out)

    with torch.no_grad():
        base = rows_loss(last)
        reached = {}
        for pos in range(20):
            moved = last.clone()
            moved[pos] += 1.0
            for i in (rows_loss(moved) != base).nonzero().squeeze(1).tolist():
                assert i not in reached
                reached[i] = pos
    assert sorted(reached) == list(range(t.rows.numel()))
    for i, pos in reached.items():
        j, k = divmod(int(t.rows[i]), B)
        doc, anchor = int(batch.block_doc[j]), int(batch.block_anchor[j])
        assert int(doc_of[pos]) == doc
        position = pos - int(cu[doc])
        assert anchor <= position == anchor + k < anchor + k + 1  # at or after the anchor, before the label
        assert int(t.prev_ids[i]) == int(input_ids[pos])  # the previous token: the same position's token


def dense_reference(drafter, hidden, t, last, mix, normalizer, dpace_alpha=None, n_rows=None):
    h = hidden[t.rows]
    w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
    logits = h @ drafter.lm_head.weight.T + w1[t.prev_ids] @ w2.T
    log_q = torch.log_softmax(logits.double(), -1)
    p = torch.softmax((last[t.target_rows] @ drafter.lm_head.weight.T).double(), -1)
    ce = F.nll_loss(log_q, t.labels, reduction="none")
    l1 = (log_q.exp() - p).abs().sum(-1)
    kl = (p * (p.log() - log_q)).sum(-1)
    total = mix.get("ce", 0) * ce + mix.get("tvd", 0) * l1 + mix.get("kl", 0) * kl
    if mix.get("bce"):
        proj = drafter.confidence_head.proj
        conf = (torch.cat([h, w1[t.prev_ids]], -1) @ proj.weight.T + proj.bias)[:, 0].double()
        accept = (1 - 0.5 * l1).clamp(0, 1).detach()
        total = total + mix["bce"] * F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
    w = t.weights.double()
    if dpace_alpha is not None:
        w = dpace_row_weights(ce.detach().float(), t.rows, n_rows, B, dpace_alpha).double()
    return (w * total).sum() / normalizer


@pytest.mark.parametrize("mix", [{"ce": 0.1, "tvd": 0.9, "bce": 1.0}, {"ce": 1.0}, {"kl": 0.5, "tvd": 0.5},
                                 {"ce": 0.1, "tvd": 0.9}])
@pytest.mark.parametrize("chunk_size", [None, 3])
@pytest.mark.parametrize("dpace", [False, True])
def test_the_loss_and_its_gradients_equal_the_dense_reference(mix, chunk_size, dpace):
    batch, input_ids, loss_mask, _ = _packed()
    t = dspark_targets(batch, input_ids, loss_mask, gamma=math.inf if dpace else 7.0)
    hidden = torch.randn(batch.block_input_ids.numel(), HIDDEN)
    last = torch.randn(20, HIDDEN)
    normalizer = float(t.weights.sum()) + 0.5
    results = []
    for run in ("ours", "dense"):
        drafter = _drafter(seed=1)
        leaf = hidden.clone().requires_grad_(True)
        if run == "ours":
            loss, hits, counts = dspark_loss(drafter, leaf, t, last, normalizer, mix, chunk_size,
                                             0.5 if dpace else None, batch.weights.numel())
            assert int(counts.sum()) == t.rows.numel()
        else:
            loss = dense_reference(drafter, leaf, t, last, mix, normalizer, 0.5 if dpace else None,
                                   batch.weights.numel())
        loss.backward()
        params = (drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight,
                  drafter.confidence_head.proj.weight, drafter.confidence_head.proj.bias)
        grads = [leaf.grad] + [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        results.append((loss.double(), grads))
    (ours, our_grads), (ref, ref_grads) = results
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    for got, want in zip(our_grads, ref_grads, strict=True):
        torch.testing.assert_close(got.double(), want.double(), rtol=1e-4, atol=1e-6)


def test_greedy_dspark_drafting_corrects_each_position_by_the_token_drafted_before_it():
    from dflash_ops.serve.dspark_decode import dspark_proposer

    drafter = _drafter()
    context = torch.randn(6, 2 * HIDDEN)
    sequence = [5, 9, 2, 11, 4, 7, 3]
    drafts = dspark_proposer(drafter)(sequence, context)
    assert len(drafts) == B  # b drafts: one per block position
    with torch.no_grad():
        block = torch.tensor([3] + [VOCAB - 1] * (B - 1))
        hidden = drafter(context, torch.arange(6), block, 6 + torch.arange(B), None)
        prev, expected = 3, []
        for k in range(B):
            prev = int(drafter.corrected_logits(hidden[k:k + 1], torch.tensor([prev])).argmax())
            expected.append(prev)
    assert drafts == expected
