"""The drafter: what each block may see, and what trains."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from dflash_ops.core.config import config_from_dict
from dflash_ops.core.target_layers import build_target_layer_ids
from dflash_ops.data.target import TargetHead, load_target, target_hidden_states
from dflash_ops.model.drafter import DFlashDrafter, DrafterConfig
from dflash_ops.model.hidden_states import get_hidden_states_packed
from dflash_ops.model.loss import build_block_batch, dflash_loss
from dflash_ops.training.trainer import DrafterTrainer, build_drafter, document_groups

BLOCK = 4
VOCAB = 50
K_LAYERS = 3


def small_drafter(num_layers: int = 2, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=4, num_layers=num_layers, num_target_features=K_LAYERS, block_size=BLOCK,
                        mask_token_id=VOCAB - 1, vocab_size=VOCAB)
    return DFlashDrafter(cfg, nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB, bias=False)).eval()


def packed_inputs(seed: int = 0):
    """Two packed documents (lengths 12 and 9) with two blocks each."""
    g = torch.Generator().manual_seed(seed)
    lengths = [12, 9]
    features = torch.randn(sum(lengths), K_LAYERS * 16, generator=g)
    input_ids = torch.randint(0, VOCAB - 1, (sum(lengths),), generator=g)
    cu_seqlens = torch.tensor([0, 12, 21], dtype=torch.int32)
    position_ids = torch.tensor(list(range(12)) + list(range(9)))
    anchors = [torch.tensor([3, 7]), torch.tensor([2, 5])]
    batch = build_block_batch(input_ids, torch.ones_like(input_ids), cu_seqlens, position_ids, anchors,
                              BLOCK, VOCAB - 1, gamma=2.0)
    return features, position_ids, batch


def block_outputs(drafter, features, position_ids, batch) -> torch.Tensor:
    with torch.no_grad():
        hidden = drafter(features, position_ids, batch.block_input_ids, batch.block_positions,
                         batch.attention_mask)
    return drafter.logits(hidden).view(-1, BLOCK, VOCAB)


@pytest.mark.parametrize("block", [0, 1, 3])
def test_context_at_or_after_the_anchor_does_not_reach_the_block(block):
    drafter = small_drafter()
    features, position_ids, batch = packed_inputs()
    doc_start = [0, 0, 12, 12][block]
    anchor = [3, 7, 2, 5][block]
    doc_end = [12, 12, 21, 21][block]
    base = block_outputs(drafter, features, position_ids, batch)[block]

    later = features.clone()
    later[doc_start + anchor: doc_end] += 10 * torch.randn(doc_end - doc_start - anchor, features.shape[1])
    assert torch.equal(block_outputs(drafter, later, position_ids, batch)[block], base)

    at_anchor_only = features.clone()
    at_anchor_only[doc_start + anchor] += 10.0
    assert torch.equal(block_outputs(drafter, at_anchor_only, position_ids, batch)[block], base)

    earlier = features.clone()
    earlier[doc_start + anchor - 1] += 10.0
    assert not torch.allclose(block_outputs(drafter, earlier, position_ids, batch)[block], base)


def test_other_documents_and_other_blocks_never_leak_in():
    drafter = small_drafter()
    features, position_ids, batch = packed_inputs()
    base = block_outputs(drafter, features, position_ids, batch)

    other_doc = features.clone()
    other_doc[12:] += 10 * torch.randn(9, features.shape[1])          # all of document 1
    changed = block_outputs(drafter, other_doc, position_ids, batch)
    assert torch.equal(changed[:2], base[:2])                          # document 0's blocks
    assert not torch.allclose(changed[2:], base[2:])

    batch.block_input_ids[BLOCK] = (batch.block_input_ids[BLOCK] + 1) % (VOCAB - 1)   # block 1's anchor
    changed = block_outputs(drafter, features, position_ids, batch)
    assert torch.equal(changed[[0, 2, 3]], base[[0, 2, 3]])
    assert not torch.allclose(changed[1], base[1])


def test_only_draft_layers_and_fc_train(tiny_target, tiny_config, tmp_path):
    cfg = config_from_dict(tiny_config(tmp_path))
    target = load_target(tiny_target)
    assert not any(p.requires_grad for p in target.parameters())
    target_before = {k: v.clone() for k, v in target.state_dict().items()}
    torch.manual_seed(0)
    drafter = build_drafter(cfg, TargetHead.of(target))
    trainer = DrafterTrainer(drafter, cfg)
    trainable_before = {k: v.clone() for k, v in drafter.trainable_state_dict().items()}

    layer_ids = build_target_layer_ids(4, 1)
    input_ids = torch.randint(0, 100, (2, 16))
    attention_mask = torch.ones_like(input_ids)
    packed = target_hidden_states(target, input_ids, attention_mask, layer_ids)
    trainer.train_step(packed.features, packed.cu_seqlens, packed.position_ids, packed.pack(input_ids),
                       torch.ones(32, dtype=torch.int64))

    trained = {name for name, p in drafter.named_parameters() if p.grad is not None}
    assert trained == set(trainable_before)
    assert all(name.startswith(("fc.", "hidden_norm.", "layers.", "norm.")) for name in trained)
    assert drafter.embed_tokens.weight.grad is None and drafter.lm_head.weight.grad is None
    optimised = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimised == {id(p) for name, p in drafter.named_parameters() if name in trainable_before}
    for name, value in drafter.trainable_state_dict().items():
        if name.endswith("proj.weight") or name == "fc.weight":
            assert not torch.equal(value, trainable_before[name]), name
    for name, value in target.state_dict().items():
        assert torch.equal(value, target_before[name]), name


def test_drafter_accepts_packed_features_from_the_target(tiny_target):
    target = load_target(tiny_target)
    input_ids = torch.randint(0, 100, (2, 10))
    mask = torch.tensor([[1] * 10, [1] * 6 + [0] * 4])
    out = target(input_ids=input_ids, attention_mask=mask, output_hidden_states=True)
    assert len(out.hidden_states) == 5
    packed = get_hidden_states_packed(out.hidden_states, [1, 3], mask)
    assert packed.features.shape == (16, 2 * 32)


def test_drafter_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="block_size must be >= 2"):
        DrafterConfig(16, 32, 4, 2, 4, 1, 3, 1, 0, 50)
    with pytest.raises(ValueError, match="not a multiple"):
        DrafterConfig(16, 32, 4, 3, 4, 1, 3, 4, 0, 50)


def test_document_groups_bound_tokens_and_blocks():
    bounds = [0, 10, 30, 35, 45, 50]
    assert document_groups(bounds, [2, 3, 0, 1, 1], max_tokens=20, max_blocks=4) == [(0, 1), (1, 2), (2, 5)]
    assert document_groups(bounds, [2, 3, 0, 1, 1], max_tokens=100, max_blocks=100) == [(0, 5)]
    assert document_groups(bounds, [0, 0, 0, 0, 1], max_tokens=15, max_blocks=1) == [(4, 5)]
    assert document_groups([0, 5], [0], 10, 10) == []


def test_grouped_step_has_the_whole_batch_gradient(tiny_target, tiny_config, tmp_path):
    # max_length 20 puts each document in its own group; the sum of the groups' backward passes
    # must equal one backward of the whole batch's loss.
    cfg = config_from_dict(tiny_config(tmp_path, data={"max_length": 20}))
    target = load_target(tiny_target)
    torch.manual_seed(0)
    trainer = DrafterTrainer(build_drafter(cfg, TargetHead.of(target)), cfg)
    reference = copy.deepcopy(trainer.drafter)
    rng_state = trainer.anchor_generator.get_state()

    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 100, (3, 20), generator=g)
    attention_mask = torch.tensor([[1] * 20, [1] * 12 + [0] * 8, [1] * 16 + [0] * 4])
    packed = target_hidden_states(target, input_ids, attention_mask, [2])
    loss_mask = torch.ones(48, dtype=torch.int64)
    result = trainer.train_step(packed.features, packed.cu_seqlens, packed.position_ids,
                                packed.pack(input_ids), loss_mask)

    trainer.anchor_generator.set_state(rng_state)
    anchors = trainer.sample_anchors(loss_mask, packed.cu_seqlens.tolist())
    batch = build_block_batch(packed.pack(input_ids), loss_mask, packed.cu_seqlens, packed.position_ids,
                              anchors, cfg.model.block_size, reference.cfg.mask_token_id, cfg.gamma)
    hidden = reference(packed.features, packed.position_ids, batch.block_input_ids, batch.block_positions,
                       batch.attention_mask)
    loss = dflash_loss(reference.logits(hidden), batch.labels, batch.weights)
    loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)
    grads = {name: p.grad for name, p in trainer.drafter.named_parameters() if p.requires_grad}
    for name, p in reference.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6)


def test_a_batch_without_anchors_still_takes_a_step(tiny_target, tiny_config, tmp_path):
    cfg = config_from_dict(tiny_config(tmp_path))
    target = load_target(tiny_target)
    trainer = DrafterTrainer(build_drafter(cfg, TargetHead.of(target)), cfg)
    input_ids = torch.randint(0, 100, (2, 12))
    packed = target_hidden_states(target, input_ids, torch.ones_like(input_ids), [2])
    result = trainer.train_step(packed.features, packed.cu_seqlens, packed.position_ids,
                                packed.pack(input_ids), torch.zeros(24, dtype=torch.int64))
    assert result.num_blocks == 0 and result.loss == 0.0 and math.isnan(result.accuracy)
    assert trainer.step == 1
    assert all(p.grad is not None for p in trainer.drafter.parameters() if p.requires_grad)
