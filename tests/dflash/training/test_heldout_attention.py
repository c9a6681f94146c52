"""The held-out evaluation attends as the training step does: the backend of the same
`model.attention_backend` on the same device, chosen by the one function both call
(`dflash_ops.model.flex.choose_attention`), so that a CUDA run evaluates on FlexAttention and not on
the tiles. FlexAttention's forward runs eagerly on CPU, so a forced flex choice (compiled or not, its
padded shapes included) is evaluated here, and its figures equal the tiles'."""

from __future__ import annotations

import pytest
import torch

from dflash_ops.core.config import config_from_dict
from dflash_ops.data.examples import Example
from dflash_ops.data.target import TargetHead, load_target, target_hidden_states
from dflash_ops.model import flex
from dflash_ops.model.attention import BlockSparseMask
from dflash_ops.model.flex import AttentionChoice, FlexBlockMask
from dflash_ops.training import trainer as trainer_module
from dflash_ops.training.heldout import HeldOutEvaluator
from dflash_ops.training.trainer import DrafterTrainer, build_drafter, resolve_layer_ids

LENGTHS, PROMPT, ANCHORS = (40, 29), 9, 8


@pytest.fixture
def setup(tiny_config, make_target, tmp_path):
    target_dir = make_target("heldout-attention")
    cfg = config_from_dict(tiny_config(tmp_path, model={"target_path": str(target_dir)},
                                       data={"max_anchors": ANCHORS}))
    target = load_target(target_dir, "float32")
    layer_ids = resolve_layer_ids(cfg, target.config.num_hidden_layers)
    torch.manual_seed(0)
    drafter = build_drafter(cfg, TargetHead.of(target))
    g = torch.Generator().manual_seed(1)
    vocab = target.config.vocab_size
    examples = [Example(torch.randint(0, vocab - 1, (n,), generator=g),
                        torch.tensor([0] * PROMPT + [1] * (n - PROMPT))) for n in LENGTHS]
    return cfg, target, layer_ids, drafter, examples


def masks_seen(drafter) -> list:
    """The attention pattern of each of the drafter's forwards from now on."""
    seen: list = []
    drafter.register_forward_pre_hook(lambda module, args: seen.append(args[4]))
    return seen


@pytest.mark.parametrize("backend", ["auto", "tiles"])
def test_the_evaluator_chooses_the_step_attention_through_the_same_function(setup, monkeypatch, backend):
    cfg, target, layer_ids, drafter, examples = setup
    calls = []
    choose = flex.choose_attention

    def spy(requested, device):
        calls.append((requested, torch.device(device)))
        return choose(requested, device)

    monkeypatch.setattr(flex, "choose_attention", spy)
    monkeypatch.setattr(trainer_module, "choose_attention", spy)
    cfg.model.attention_backend = backend
    trainer = DrafterTrainer(drafter, cfg)
    heldout = HeldOutEvaluator.of(target, examples, layer_ids, ANCHORS, cfg.gamma,
                                  attention_backend=cfg.model.attention_backend)
    seen = masks_seen(drafter)
    packed = target_hidden_states(target, examples[0].input_ids[None],
                                  torch.ones(1, LENGTHS[0], dtype=torch.int64), layer_ids)
    trainer.train_step(packed.features, packed.cu_seqlens, packed.position_ids, examples[0].input_ids,
                       examples[0].loss_mask)
    step_masks, seen[:] = list(seen), []
    heldout(drafter)
    assert len(calls) == 2 and calls[0] == calls[1], calls  # the step's choice, then the evaluator's
    assert seen and {type(m) for m in seen} == {type(m) for m in step_masks}, (seen, step_masks)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_flex_choice_evaluates_on_flex_with_the_tiles_figures(setup, monkeypatch, compiled):
    cfg, target, layer_ids, drafter, examples = setup
    heldout = HeldOutEvaluator.of(target, examples, layer_ids, ANCHORS, cfg.gamma)
    seen = masks_seen(drafter)
    tiles = heldout(drafter)
    assert seen and all(isinstance(m, BlockSparseMask) for m in seen)  # auto on CPU: the tiles
    seen[:] = []
    monkeypatch.setattr(flex, "choose_attention", lambda requested, device: AttentionChoice("flex", compiled,
                                                                                             "forced"))
    monkeypatch.setattr(flex, "_compiled", lambda fn, compiled: fn)  # the compiled shapes, run eagerly
    on_flex = heldout(drafter)
    assert seen and all(isinstance(m, FlexBlockMask) for m in seen), seen
    if compiled:  # one shape for every pass: the longest document's context, a full chunk's blocks
        shapes = {(m.context_rows, m.query_rows) for m in seen}
        queries = ANCHORS * drafter.cfg.block_size
        assert shapes == {(flex.padded_rows(max(LENGTHS)), flex.padded_rows(queries))}
    assert on_flex.loss == pytest.approx(tiles.loss, rel=1e-5, abs=1e-6)
    assert on_flex.stats.lengths == tiles.stats.lengths
