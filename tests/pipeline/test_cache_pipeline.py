"""A pipeline of drafters only, fed by a feature cache: the online losses across a resume, and a bad
cache refused by the launcher before any worker starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_ops.core.config import load_config
from dflash_ops.data.capture import capture
from dflash_ops.data.feature_cache import MANIFEST
from tests.dflash.data.test_feature_cache import Log, corrupt
from tests.pipeline.test_pipeline_run import step_losses

DRAFTERS_ONLY = {"target_workers": 0, "drafter_workers": 1, "threads_per_worker": 1, "queue_depth": 2}


@pytest.fixture
def features(write_config, tmp_path) -> Path:
    """The demo data set's features, captured as a run of write_config's configs orders its batches."""
    out = tmp_path / "features"
    capture(load_config(write_config("capture")), out, shard_bytes=64 << 10, log=Log())
    assert len(json.loads((out / MANIFEST).read_text())["shards"]) > 2
    return out


@pytest.mark.slow
def test_drafters_from_the_cache_give_the_online_losses_across_a_resume(write_config, start_run, features):
    steps = 12
    single = start_run(write_config("single", optim={"total_steps": steps}))
    assert single.wait(timeout=240) == 0, single.log_path.read_text()[-3000:]
    config = write_config("cached", optim={"total_steps": steps}, run={"max_steps_per_run": steps // 2},
                          data={"features_path": str(features), "eval_path": None}, pipeline=DRAFTERS_ONLY)
    first = start_run(config)
    assert first.wait(timeout=240) == 0, first.log_path.read_text()[-3000:]
    second = start_run(config)
    assert second.wait(timeout=240) == 0, second.log_path.read_text()[-3000:]
    assert [e["step"] for e in second.events() if e["event"] == "resume"] == [steps // 2]
    assert step_losses(first.events()) + step_losses(second.events()) == step_losses(single.events())
    status = second.status()
    assert status["state"] == "stopped" and status["step"] == steps
    assert set(status["workers"]) == {"drafter0"}
    assert not second.group_alive()


def test_the_launcher_refuses_a_corrupt_cache_before_any_worker_starts(write_config, start_run, features):
    corrupt(features / "shard-00001.safetensors")
    run = start_run(write_config("corrupt", data={"features_path": str(features), "eval_path": None,
                                                  "features_verify": "checksums"}, pipeline=DRAFTERS_ONLY))
    assert run.wait(timeout=120) == 2
    log = run.log_path.read_text()
    assert "data.features_path: " in log and "shard-00001.safetensors is corrupt" in log
    assert "Traceback" not in log and not any(e["event"] == "worker_start" for e in run.events())
    assert not (run.output_dir / "checkpoints").exists()


def test_a_cache_fed_pipeline_with_a_held_out_set_is_refused_before_any_worker_starts(write_config, start_run,
                                                                                     features):
    """Its held-out features would need a target, and it has no target rank: no drafter loads one."""
    run = start_run(write_config("heldout", data={"features_path": str(features)}, pipeline=DRAFTERS_ONLY))
    assert run.wait(timeout=120) == 2
    log = run.log_path.read_text()
    assert "data.eval_path: needs a target rank" in log and not any(
        e["event"] == "worker_start" for e in run.events())
