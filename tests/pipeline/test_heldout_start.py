"""A pipeline's start does nothing long ahead of its first collective: the held-out features come from
target rank 0 (its own device, sent like a batch), never from a drafter loading the target, and the
held-out figures are the single-process trainer's.

Which process loads the target is recorded by a `sitecustomize` on the workers' path (every process
torchrun starts imports it) that wraps `dflash_ops.data.target.load_target` and notes the rank that called
it."""

from __future__ import annotations

import json
import os

import pytest

from dflash_ops.core.stopping import PROCESS_GROUP_TIMEOUT, STARTUP_TIMEOUT
from tests.pipeline.test_pipeline_run import PIPELINE

RECORDER = '''
import json, os
from dflash_ops.data import target as _target

_load = _target.load_target


def load_target(*args, **kwargs):
    with open(os.environ["DFLASH_TEST_LOADS"], "a") as out:
        out.write(json.dumps({"rank": os.environ.get("RANK"), "pid": os.getpid()}) + "\\n")
    return _load(*args, **kwargs)


_target.load_target = load_target
'''


def heldout(events: list[dict]) -> list[tuple]:
    return [(e["step"], e["heldout_loss"], e["heldout_tau"]) for e in events if e["event"] == "heldout"]


@pytest.mark.slow
def test_the_held_out_features_come_from_a_target_rank_and_no_drafter_loads_the_target(
        write_config, start_run, tmp_path):
    assert STARTUP_TIMEOUT > PROCESS_GROUP_TIMEOUT  # the start's waits have a timeout of their own
    sections = {"optim": {"total_steps": 8}, "run": {"eval_every": 4}}
    single = start_run(write_config("single", **sections))
    assert single.wait(timeout=240) == 0, single.log_path.read_text()[-3000:]
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(RECORDER)
    loads = tmp_path / "loads.jsonl"
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "DFLASH_TEST_LOADS": str(loads)}
    # Two targets feed one drafter: the steps are the single process's, bit for bit.
    run = start_run(write_config("pipeline", pipeline=PIPELINE, **sections), env=env)
    assert run.wait(timeout=240) == 0, run.log_path.read_text()[-3000:]

    roles = {str(e["rank"]): e["worker"] for e in run.events() if e["event"] == "worker_start"}
    loaded_by = sorted(roles[json.loads(line)["rank"]] for line in loads.read_text().splitlines()
                       if json.loads(line)["rank"] is not None)
    assert loaded_by == ["target0", "target1"], loaded_by  # each target once; no drafter
    # Target rank 0 computed and sent them a training batch of rows at a time: 8 examples, 2 batches of 4.
    sent = [e for e in run.events() if e["event"] == "heldout_sent"]
    shown = [(e["worker"], e["examples"], e["batches"], e["rows_per_batch"]) for e in sent]
    assert shown == [("target0", 8, 2, 4)], shown
    got, want = heldout(run.events()), heldout(single.events())
    assert [s for s, _, _ in got] == [s for s, _, _ in want] == [4, 8]
    for (_, loss, tau), (_, want_loss, want_tau) in zip(got, want, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-4) and tau == pytest.approx(want_tau, abs=1e-3)
