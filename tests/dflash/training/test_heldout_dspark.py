"""The held-out evaluation of a DSpark drafter (`model.kind: dspark`) measures it as vLLM's DSparkProposer
serves it: on data that is the target's own greedy output, its tau and acceptance by position are
`dflash_ops.evaluate`'s (b drafts a step, verified with a block of b + 1); its loss is the decay-weighted
cross entropy of the Markov-corrected logits at DSpark's alignment (the `ce` term of `dspark_loss`). Its peak
memory: tests/dflash/training/test_heldout_memory.py, for either kind."""

from __future__ import annotations

import pytest
import torch

from dflash_ops.core.config import config_from_dict
from dflash_ops.data.examples import Example
from dflash_ops.data.target import TargetHead, load_target, target_hidden_states
from dflash_ops.model.acceptance import AcceptanceStats
from dflash_ops.model.dspark import DSparkDrafter, dspark_loss, dspark_targets
from dflash_ops.model.loss import build_block_batch
from dflash_ops.serve.evaluate import kind_proposer, speculative_decode
from dflash_ops.training.heldout import HeldOutEvaluator
from dflash_ops.training.trainer import build_drafter, resolve_layer_ids

VOCAB = 128  # the tiny target's
DSPARK = {"kind": "dspark", "markov_rank": VOCAB, "confidence_head": False}
ANCHORS, CHUNK = 5, 8  # several chunks a document; two blocks of b = 4 per head pass, and a last one alone


@pytest.fixture
def setup(tiny_config, tiny_target, tmp_path):
    cfg = config_from_dict(tiny_config(tmp_path, model=DSPARK, data={"max_anchors": ANCHORS}))
    target = load_target(tiny_target, "float32")
    layer_ids = resolve_layer_ids(cfg, target.config.num_hidden_layers)
    torch.manual_seed(0)
    drafter = build_drafter(cfg, TargetHead.of(target))
    assert isinstance(drafter, DSparkDrafter) and drafter.cfg.block_size == 4
    return cfg, target, layer_ids, drafter


def greedy_examples(target, n: int, new_tokens: int) -> tuple[list[list[int]], list[Example]]:
    """Random prompts and the target's own greedy continuation of each, as held-out examples."""
    g = torch.Generator().manual_seed(3)
    prompts, examples = [], []
    for i in range(n):
        prompt = torch.randint(0, VOCAB - 1, (6 + i,), generator=g)
        out = target.generate(input_ids=prompt[None], attention_mask=torch.ones_like(prompt[None]),
                              max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        prompts.append(prompt.tolist())
        examples.append(Example(out[0], torch.tensor([0] * prompt.numel() + [1] * new_tokens)))
    return prompts, examples


def bigram_markov_head(drafter: DSparkDrafter, examples: list[Example]) -> None:
    """A Markov head (rank = vocab) that drafts, after token t, the token that last followed t in the
    examples (where t is seen): most drafts of their repetitive greedy text are accepted, not all."""
    follows = {}
    for example in examples:
        ids = example.input_ids.tolist()
        follows.update(zip(ids[:-1], ids[1:], strict=True))
    markov = drafter.markov_head
    with torch.no_grad():
        markov.markov_w1.weight.copy_(torch.eye(VOCAB))
        markov.markov_w2.weight.zero_()
        for prev, nxt in follows.items():
            markov.markov_w2.weight[nxt, prev] = 50.0


def test_the_heldout_tau_of_a_dspark_drafter_equals_evaluates_on_the_targets_greedy_output(setup):
    cfg, target, layer_ids, drafter = setup
    b = drafter.cfg.block_size
    new_tokens = 30
    prompts, examples = greedy_examples(target, 3, new_tokens)
    bigram_markov_head(drafter, examples)
    replayed = HeldOutEvaluator.of(target, examples, layer_ids, ANCHORS, cfg.gamma, CHUNK)(drafter)

    propose, verify_block = kind_proposer(drafter)  # as dflash_ops.evaluate measures a DSpark drafter
    assert verify_block == b + 1
    decoded = AcceptanceStats("decoded", verify_block)
    for prompt, example in zip(prompts, examples, strict=True):
        output = speculative_decode(target, propose, prompt, layer_ids, verify_block, new_tokens, None,
                                    decoded)
        assert output == example.input_ids[len(prompt):].tolist()  # the data is the target's greedy output

    assert replayed.stats.block_size == b + 1
    assert replayed.stats.lengths == decoded.lengths
    assert replayed.stats.generated_tokens == decoded.generated_tokens == 3 * new_tokens
    assert replayed.stats.acceptance_by_position() == decoded.acceptance_by_position()
    assert len(replayed.stats.acceptance_by_position()) == b  # b drafts a step, position 0's included
    # Not a trivial figure: some steps accept all b drafts (tau beyond DFlash's bound b), some fewer.
    assert max(decoded.lengths) == b + 1 and min(decoded.lengths) < b + 1 and replayed.stats.tau > 2.0
    fields = replayed.as_fields()
    assert fields["heldout_tau"] == round(decoded.tau, 4)
    assert len(fields["heldout_acceptance_by_position"]) == b


def test_the_heldout_loss_of_a_dspark_drafter_is_the_decay_weighted_ce_of_its_corrected_logits(setup):
    cfg, target, layer_ids, drafter = setup
    torch.manual_seed(1)
    with torch.no_grad():  # a Markov head that changes the logits (a fresh one adds nothing)
        drafter.markov_head.markov_w2.weight.normal_(std=2.0)
    g = torch.Generator().manual_seed(2)
    length, prompt = 37, 7
    ids = torch.randint(0, VOCAB - 1, (length,), generator=g)
    mask = torch.tensor([0] * prompt + [1] * 12 + [0] * 5 + [1] * (length - prompt - 17))  # a second turn
    result = HeldOutEvaluator.of(target, [Example(ids, mask)], layer_ids, ANCHORS, cfg.gamma, CHUNK)(drafter)

    # The reference: every response anchor in one chunk, the rows and weights of the DSpark training loss,
    # its ce term alone, divided by the rows' weights.
    features = target_hidden_states(target, ids[None], torch.ones(1, length, dtype=torch.long), layer_ids)
    positions = torch.arange(length)
    batch = build_block_batch(ids, mask, torch.tensor([0, length], dtype=torch.int32), positions,
                              [torch.arange(prompt, length - 1)], drafter.cfg.block_size,
                              drafter.cfg.mask_token_id, cfg.gamma)
    drafter.eval()
    with torch.no_grad():
        hidden = drafter(features.features, positions, batch.block_input_ids, batch.block_positions,
                         batch.sparse_mask)
        targets = dspark_targets(batch, ids, mask, cfg.gamma)
        expected, _, _ = dspark_loss(drafter, hidden, targets, None, targets.weights.sum(), {"ce": 1.0})
    assert result.loss == pytest.approx(float(expected), rel=1e-5)
    assert 0 in targets.offsets.tolist()  # position 0 (the anchor's own row) is scored, as in training
