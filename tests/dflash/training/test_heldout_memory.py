"""The held-out evaluation inside the training step's memory bound: its blocks go through the block-sparse
attention and the lm_head a chunk of rows at a time (`model.loss_chunk_size`), so its peak is no higher
than a training step's at the same shape and far below one chunk's `[blocks x b, vocab]` logits (which
the evaluation held, with their log-softmax, before)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.memory import peak_allocated_bytes
from dflash_ops.core.config import config_from_dict
from dflash_ops.data.examples import Example
from dflash_ops.data.target import TargetHead, load_target, target_hidden_states
from dflash_ops.training.heldout import HeldOutEvaluator
from dflash_ops.training.trainer import DrafterTrainer, build_drafter, compute_precision, resolve_layer_ids

VOCAB, LENGTH, PROMPT, ANCHORS, CHUNK = 8192, 160, 16, 64, 32


# A DSpark drafter's held-out pass adds its Markov correction a position at a time ([blocks, vocab]).
KINDS = {"dflash": {}, "dspark": {"kind": "dspark", "markov_rank": 8}}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_heldout_peak_is_no_higher_than_a_training_step_at_the_same_shape(make_target, tiny_config,
                                                                            tmp_path, kind):
    target_dir = make_target("wide-vocab", vocab_size=VOCAB)
    model = {"target_path": str(target_dir), "loss_chunk_size": CHUNK, **KINDS[kind]}
    raw = tiny_config(tmp_path, model=model, data={"max_anchors": ANCHORS, "max_length": LENGTH})
    cfg = config_from_dict(raw)
    target = load_target(target_dir, "float32")
    layer_ids = resolve_layer_ids(cfg, target.config.num_hidden_layers)
    torch.manual_seed(0)
    drafter = build_drafter(cfg, TargetHead.of(target))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB - 1, (LENGTH,), generator=g)
    mask = torch.tensor([0] * PROMPT + [1] * (LENGTH - PROMPT))
    heldout = HeldOutEvaluator.of(target, [Example(ids, mask)], layer_ids, ANCHORS, cfg.gamma, CHUNK,
                                  lambda device: compute_precision(cfg, device))
    block_size = drafter.cfg.block_size

    result, heldout_peak = peak_allocated_bytes(lambda: heldout(drafter))
    assert result.stats.lengths and result.loss > 0  # it evaluated every anchor, in chunks of ANCHORS
    assert result.stats.block_size == block_size + (kind == "dspark")  # DSpark: b drafts, verified by b + 1

    packed = target_hidden_states(target, ids[None], torch.ones(1, LENGTH, dtype=torch.int64), layer_ids)
    trainer = DrafterTrainer(drafter, cfg)
    _, train_peak = peak_allocated_bytes(lambda: trainer.train_step(
        packed.features, packed.cu_seqlens, packed.position_ids, ids, mask))
    chunk_logits = ANCHORS * block_size * VOCAB * 4  # what one chunk's float32 logits alone took
    assert heldout_peak <= train_peak, (heldout_peak, train_peak)
    assert heldout_peak < chunk_logits / 2, (heldout_peak, chunk_logits)
