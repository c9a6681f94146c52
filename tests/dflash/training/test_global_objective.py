"""The objective across drafters: one token-weighted mean over every drafter's scored positions.

Two and three drafter processes (gloo, DDP, as a pipeline's drafters train) each take a ragged shard of
the same documents (other lengths, other counts, one shard with nothing scored); after one step each
drafter's gradient equals, to 1e-6, the gradient of one process on all the documents in one batch, and
the step they log (`reduce_step`) has that process's loss and accuracy, defined although a drafter
scored nothing. Every anchor of a document is taken (max_anchors above their count), so the drafters
and the single process score the same blocks."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_ops.core.config import config_from_dict
from dflash_ops.data.target import TargetHead, load_target
from dflash_ops.training.trainer import DrafterTrainer, build_drafter, resolve_layer_ids

RANK = Path(__file__).with_name("objective_rank.py")
REPO = Path(__file__).resolve().parents[3]


def documents(seed: int) -> list[list[tuple[list[int], list[int]]]]:
    """Three shards of (input_ids, loss_mask) documents of ragged lengths; the last scores nothing."""
    g = torch.Generator().manual_seed(seed)

    def doc(length: int, prompt: int, scored: bool = True):
        ids = torch.randint(0, 100, (length,), generator=g).tolist()
        return ids, [0] * prompt + [int(scored)] * (length - prompt)

    return [[doc(30, 6), doc(18, 4)], [doc(40, 10)], [doc(22, 5, scored=False), doc(12, 3, scored=False)]]


# 3 drafters under make test-reliability only (half a minute of three trainer processes): make test
# keeps 2.
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.reliability_full)])
def test_the_drafters_gradient_is_one_process_on_the_whole_batch(world, tiny_config, tmp_path):
    raw = tiny_config(tmp_path / "run", data={"max_anchors": 512}, optim={"max_grad_norm": 1.0e9})
    cfg = config_from_dict(raw)
    target = load_target(cfg.model.target_path, "float32")
    layer_ids = resolve_layer_ids(cfg, target.config.num_hidden_layers)
    shards = documents(world)[:world]
    spec = tmp_path / "spec.pt"
    torch.save({"config": raw, "shards": shards, "layer_ids": layer_ids}, spec)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, str(RANK), str(rank), str(world), str(tmp_path / "init"),
                               str(spec), str(tmp_path / f"rank{rank}.pt")], env=env)
             for rank in range(world)]
    assert [p.wait(timeout=300) for p in procs] == [0] * world

    sys.path.insert(0, str(RANK.parent))
    try:
        from objective_rank import step_on
    finally:
        sys.path.remove(str(RANK.parent))
    torch.manual_seed(0)
    single = DrafterTrainer(build_drafter(cfg, TargetHead.of(target)), cfg)
    want = step_on(single, target, [d for shard in shards for d in shard], layer_ids)
    want_grads = {n: p.grad for n, p in single.drafter.named_parameters() if p.grad is not None}

    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
    for rank, got in enumerate(ranks):
        assert set(got["grads"]) == set(want_grads) and len(want_grads) > 4
        for name, grad in want_grads.items():
            assert grad.abs().sum() > 0, name
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-6, atol=1e-6, msg=f"{rank} {name}")
        reduced = got["reduced"]
        assert reduced["loss"] == pytest.approx(want.loss, rel=1e-6)
        assert reduced["accuracy"] == pytest.approx(want.accuracy, rel=1e-9)
        assert (reduced["position_hits"], reduced["position_counts"]) == (want.position_hits,
                                                                          want.position_counts)
        assert reduced["num_blocks"] == want.num_blocks and reduced["num_tokens"] == want.num_tokens
    if world == 3:  # the third drafter scored nothing: its own accuracy is undefined, the step's is not
        assert math.isnan(ranks[2]["local"]["accuracy"]) and math.isfinite(ranks[2]["reduced"]["accuracy"])
