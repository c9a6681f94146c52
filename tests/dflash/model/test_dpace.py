"""D-PACE (`optim.loss_weighting: dpace`): its weights pinned on hand-computed blocks, the same loss and
gradient chunked and unchunked, and a run that records it and refuses to resume under the other weighting."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dflash_ops.core.config import ConfigError, config_from_dict
from dflash_ops.model.loss import chunked_head_loss, dflash_loss, dpace_row_weights, dpace_weights
from dflash_ops.run.main import run_single_process
from dflash_ops.serve.export import export_checkpoint
from dflash_ops.training.checkpoint import check_loss_weighting, latest_checkpoint


def ce_of(confidences: list[float]) -> torch.Tensor:
    """The cross entropies whose confidences exp(-ce) are `confidences` (one block)."""
    return -torch.log(torch.tensor([confidences], dtype=torch.float64))


def test_weights_by_hand_every_position_scored():
    # q = 0.8, 0.6, 0.4 after the anchor; alpha 0.5: q~ = 0.9, 0.8, 0.7; P = 0.9, 0.72, 0.504;
    # w_j = the sum of P_m for m >= j.
    ce = ce_of([0.5, 0.8, 0.6, 0.4])
    scored = torch.tensor([[False, True, True, True]])
    got = dpace_weights(ce, scored, alpha=0.5)
    torch.testing.assert_close(got, torch.tensor([[0.0, 2.124, 1.224, 0.504]]), rtol=0, atol=1e-6)


def test_a_position_not_scored_is_a_no_op_in_the_products_and_has_no_weight():
    # Position 2 unscored: q~ = 0.9, 1, 0.7; P = 0.9, (0.9), 0.63, and only scored P_m are summed.
    ce = ce_of([0.5, 0.8, 0.6, 0.4])
    scored = torch.tensor([[False, True, False, True]])
    got = dpace_weights(ce, scored, alpha=0.5)
    torch.testing.assert_close(got, torch.tensor([[0.0, 1.53, 0.0, 0.63]]), rtol=0, atol=1e-6)


def test_alpha_one_ignores_the_confidence_and_counts_the_positions_left():
    ce = ce_of([0.5, 0.1, 0.99, 0.3])
    got = dpace_weights(ce, torch.tensor([[False, True, True, True]]), alpha=1.0)
    torch.testing.assert_close(got, torch.tensor([[0.0, 3.0, 2.0, 1.0]]), rtol=0, atol=1e-6)


def test_row_weights_follow_each_block_of_the_rows():
    # Two blocks of 3; scored rows 1, 2 (block 0) and 4 (block 1).
    rows = torch.tensor([1, 2, 4])
    ce = -torch.log(torch.tensor([0.6, 0.2, 0.5]))
    got = dpace_row_weights(ce, rows, n_rows=6, block_size=3, alpha=0.5)
    # block 0: q~ = 0.8, 0.6 -> P = 0.8, 0.48 -> w = 1.28, 0.48; block 1: q~ = 0.75 -> w = 0.75
    torch.testing.assert_close(got, torch.tensor([1.28, 0.48, 0.75]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 5, 1000])
def test_the_chunked_head_gives_the_unchunked_loss_and_gradient(chunk_size):
    g = torch.Generator().manual_seed(0)
    vocab, block_size, n_blocks = 53, 4, 6
    head = torch.nn.Linear(16, vocab, bias=False).requires_grad_(False)
    scored = torch.rand(n_blocks * block_size, generator=g) > 0.3
    scored[::block_size] = False  # the anchors
    rows = torch.arange(scored.numel())[scored]
    h = torch.randn(int(scored.sum()), 16, generator=g)
    labels = torch.randint(0, vocab, (rows.numel(),), generator=g)
    mask = torch.ones(rows.numel())
    weigh = lambda ce: dpace_row_weights(ce, rows, scored.numel(), block_size, 0.5)  # noqa: E731

    hidden = h.clone().requires_grad_()
    reference = dflash_loss(head(hidden), labels, mask, normalizer=9.0, weigh=weigh)
    reference_grad, = torch.autograd.grad(reference, hidden)
    # The same by hand: the detached weights times the cross entropies, over the normalizer.
    ce = torch.nn.functional.cross_entropy(head(h), labels, reduction="none")
    torch.testing.assert_close(reference, (weigh(ce) * ce).sum() / 9.0)

    hidden = h.clone().requires_grad_()
    loss, _, counts = chunked_head_loss(hidden, head, labels, mask, rows % block_size, block_size, chunk_size,
                                        normalizer=9.0, weigh=weigh)
    loss.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(hidden.grad, reference_grad, rtol=1e-6, atol=1e-7)
    assert sum(counts) == rows.numel()


def test_the_config_key_is_checked(tiny_config, tmp_path):
    with pytest.raises(ConfigError, match="optim.loss_weighting"):
        config_from_dict(tiny_config(tmp_path, optim={"loss_weighting": "dpac"}))
    with pytest.raises(ConfigError, match="optim.dpace_alpha"):
        config_from_dict(tiny_config(tmp_path, optim={"loss_weighting": "dpace", "dpace_alpha": 1.5}))
    decay = config_from_dict(tiny_config(tmp_path)).loss_weighting
    assert decay["loss_weighting"] == "decay" and decay["gamma"] > 0
    check_loss_weighting(decay, {})  # a checkpoint from before the key trained with the decay
    with pytest.raises(ConfigError, match="optim.loss_weighting"):
        check_loss_weighting({"loss_weighting": "dpace", "dpace_alpha": 0.5}, {})


def test_a_dpace_run_records_it_and_refuses_to_resume_under_the_decay(tiny_config, tmp_path, capsys):
    run = tmp_path / "run"
    dpace = config_from_dict(tiny_config(run, optim={"total_steps": 4, "loss_weighting": "dpace"}))
    assert run_single_process(dpace) == 0
    steps = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"step"' in line]
    assert any(e.get("event") == "step" and math.isfinite(e["loss"]) for e in steps)
    meta = json.loads((latest_checkpoint(run) / "meta.json").read_text())
    assert meta["loss_weighting"] == {"loss_weighting": "dpace", "dpace_alpha": 0.5}
    exported = export_checkpoint(latest_checkpoint(run), tmp_path / "export")
    recorded = json.loads((exported / "config.json").read_text())["dflash_training"]
    # The tiny data has no manifest: its mode is the config's default, which nothing confirmed.
    assert recorded == {**meta["loss_weighting"], "enable_thinking": False,
                        "enable_thinking_confirmed": False}
    readme = " ".join((exported / "README.md").read_text().split())
    assert "non-thinking answers (`data.enable_thinking: false`), which no data manifest confirmed" in readme

    decay = config_from_dict(tiny_config(run, optim={"total_steps": 6}))
    assert run_single_process(decay) == 2
    assert "optim.loss_weighting" in capsys.readouterr().out
