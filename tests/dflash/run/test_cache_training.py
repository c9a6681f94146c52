"""Training from a feature cache in one process: the online losses bit for bit in the epoch the
capture ran, the target never loaded for training, and an exact resume across the cache."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_ops.core.config import config_from_dict
from dflash_ops.core.runtime import StopSignal
from dflash_ops.data.capture import capture
from dflash_ops.data.examples import BatchOrder
from dflash_ops.run import cache_feed
from dflash_ops.run.transport import FEED_DONE
from dflash_ops.training.checkpoint import latest_checkpoint, load_checkpoint
from tests.dflash.data.test_feature_cache import SMALL_SHARDS, Log
from tests.dflash.training.test_train import step_losses, train_in_process

EPOCH = 8  # steps: 32 examples in batches of 4


@pytest.fixture
def from_cache(tiny_config, tmp_path):
    """Factory: `from_cache(name, **sections)` -> the config mapping of a run that reads the tiny data
    set's features from a cache (captured once, for the first call)."""
    out = tmp_path / "cache"

    def make(name: str, **sections) -> dict:
        raw = tiny_config(tmp_path / name, **sections)
        if not out.exists():
            capture(config_from_dict(raw), out, shard_bytes=SMALL_SHARDS, log=Log())
        raw["data"]["features_path"] = str(out)
        return raw

    return make


def test_an_epoch_from_the_cache_gives_the_online_losses_bit_for_bit(
        tiny_config, tiny_eval_dataset, from_cache, tmp_path, capsys, monkeypatch):
    sections = {"optim": {"total_steps": EPOCH}, "data": {"eval_path": str(tiny_eval_dataset)},
                "run": {"eval_every": 4}}
    code, online = train_in_process(tiny_config(tmp_path / "online", **sections), capsys)
    assert code == 0
    raw = from_cache("cached", **sections)
    loaded = []
    real_load_target = cache_feed.load_target
    monkeypatch.setattr(cache_feed, "load_target",
                        lambda *args, **kwargs: loaded.append(args) or real_load_target(*args, **kwargs))
    code, cached = train_in_process(raw, capsys)
    assert code == 0
    assert step_losses(cached) == step_losses(online) and len(step_losses(cached)) == EPOCH
    assert [r["heldout_loss"] for r in cached if r["event"] == "heldout"] == [
        r["heldout_loss"] for r in online if r["event"] == "heldout"]
    assert len(loaded) == 1, "the target is loaded once, for the held-out features, never to train"
    ours = load_checkpoint(latest_checkpoint(tmp_path / "cached"))[0]
    theirs = load_checkpoint(latest_checkpoint(tmp_path / "online"))[0]
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_run_from_the_cache_resumes_exactly_across_epochs(tiny_config, from_cache, tmp_path, capsys):
    steps = EPOCH + 4  # into the second epoch: other batches of the cached documents
    code, whole = train_in_process(from_cache("whole", optim={"total_steps": steps}), capsys)
    assert code == 0
    expected = step_losses(whole)
    assert sorted(expected) == list(range(1, steps + 1))

    raw = from_cache("resumed", optim={"total_steps": steps}, run={"max_steps_per_run": 5, "save_every": 100})
    losses = {}
    for first in (1, 6, 11):
        code, records = train_in_process(raw, capsys)
        assert code == 0
        got = step_losses(records)
        assert min(got) == first
        losses.update(got)
    assert losses == expected

    # Past the captured epoch a document's features are those of its capture batch (another padded
    # length): the online losses up to the target's rounding.
    code, online = train_in_process(tiny_config(tmp_path / "online", optim={"total_steps": steps}), capsys)
    online_losses = step_losses(online)
    assert [online_losses[s] for s in range(1, EPOCH + 1)] == [expected[s] for s in range(1, EPOCH + 1)]
    assert all(math.isclose(online_losses[s], expected[s], rel_tol=1e-5) for s in range(EPOCH + 1, steps + 1))


def test_each_drafter_reads_its_share_of_the_schedule_from_a_resumed_position(from_cache):
    cfg = config_from_dict(from_cache("feeds"))
    cache = cache_feed.FeatureCache(cfg.data.features_path)
    order = BatchOrder(len(cache), cfg.data.batch_size, cfg.run.seed)
    for _ in range(5):  # a resumed run: its data position is 5 batches in
        order.next_batch()
    expected = BatchOrder(len(cache), cfg.data.batch_size, cfg.run.seed)
    expected.load_state_dict(order.state_dict())
    batches = [expected.next_batch() for _ in range(12)]  # batches 10..21 (steps 5..10 of 2 drafters)
    for rank in (0, 1):
        feed = cache_feed.CacheFeed(cache, order, 10, 22, rank, 2, depth=2)
        got = []
        while isinstance(item := feed.next(StopSignal()), dict):
            got.append((feed.last_index, feed.last_indices, item))
        assert item == FEED_DONE and feed.error is None
        assert [index for index, _, _ in got] == list(range(10 + rank, 22, 2))
        assert [indices for _, indices, _ in got] == batches[rank::2]
        for _, _, batch in got:
            assert batch["features"].shape == (int(batch["cu_seqlens"][-1]), 32)
            assert batch["cu_seqlens"].dtype == torch.int32 and batch["input_ids"].dtype == torch.int64
