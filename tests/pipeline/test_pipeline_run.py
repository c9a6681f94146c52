"""The multi-process pipeline on CPU: 2 target workers feed 1 drafter worker."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from dflash_ops.training.checkpoint import latest_checkpoint, load_checkpoint
from tests.waiting import wait_for

PIPELINE = {"target_workers": 2, "drafter_workers": 1, "threads_per_worker": 1, "queue_depth": 2}
# Two drafters: the stop is agreed between them (DDP) and each target tells both it has ended.
TWO_DRAFTERS = {**PIPELINE, "drafter_workers": 2}


def step_losses(events: list[dict]) -> list[float]:
    return [e["loss"] for e in events if e["event"] == "step"]


def ragged_dataset(demo_dir: Path, path: Path) -> Path:
    """The demo's training rows cut to random lengths (32 to 64 tokens): documents of different
    lengths draw different numbers of anchors, so each drafter's anchor RNG ends up elsewhere."""
    rng = random.Random(0)
    rows = [json.loads(line) for line in (demo_dir / "data" / "train.jsonl").read_text().splitlines()]
    with path.open("w") as f:
        for row in rows:
            n = rng.randint(32, len(row["input_ids"]))
            f.write(json.dumps({key: values[:n] for key, values in row.items()}) + "\n")
    return path


@pytest.mark.slow
def test_pipeline_losses_equal_the_single_process_trainer_across_a_resume(write_config, start_run):
    steps = 12
    single = start_run(write_config("single", optim={"total_steps": steps}))
    assert single.wait(timeout=240) == 0, single.log_path.read_text()[-3000:]
    # The pipeline stops half-way (max_steps_per_run) and a second run resumes from its checkpoint.
    config = write_config("pipeline", optim={"total_steps": steps}, run={"max_steps_per_run": steps // 2},
                          pipeline=PIPELINE)
    first = start_run(config)
    assert first.wait(timeout=240) == 0, first.log_path.read_text()[-3000:]
    assert first.status()["step"] == steps // 2
    pipeline = start_run(config)
    assert pipeline.wait(timeout=240) == 0, pipeline.log_path.read_text()[-3000:]
    assert [e["step"] for e in pipeline.events() if e["event"] == "resume"] == [steps // 2]

    expected = step_losses(single.events())
    got = step_losses(first.events()) + step_losses(pipeline.events())
    assert len(got) == steps
    # Same batches, same target features (sent through gloo unchanged), same init and anchor RNG.
    assert got == expected
    assert sum(got[-3:]) / 3 < sum(got[:3]) / 3 - 0.3, got

    status = pipeline.status()
    assert status["state"] == "stopped" and status["step"] == steps
    assert status["loss"] == got[-1]
    assert set(status["workers"]) == {"drafter0", "target0", "target1"}
    assert all(w["state"] == "exited" for w in status["workers"].values())
    # The drafter's final checkpoint holds the same weights as the single-process run's.
    ours, theirs = latest_checkpoint(pipeline.output_dir), latest_checkpoint(single.output_dir)
    assert ours.name == theirs.name == f"step-{steps:08d}"
    ours_weights, theirs_weights = load_checkpoint(ours)[0], load_checkpoint(theirs)[0]
    assert all((ours_weights[k] == theirs_weights[k]).all() for k in theirs_weights)
    assert not pipeline.group_alive()


@pytest.mark.slow
def test_sigterm_checkpoints_leaves_nothing_running_and_two_drafters_resume_exactly(
        write_config, start_run, pid_alive, demo_dir, tmp_path):
    steps = 16
    sections = {"data": {"path": str(ragged_dataset(demo_dir, tmp_path / "ragged.jsonl"))},
                "optim": {"total_steps": steps}, "pipeline": TWO_DRAFTERS}
    reference = start_run(write_config("reference", **sections))
    assert reference.wait(timeout=240) == 0, reference.log_path.read_text()[-3000:]
    expected = step_losses(reference.events())
    assert len(expected) == steps

    run = start_run(write_config("term", run={"step_delay": 0.3}, **sections))
    # status.json follows the run: the launcher's pid, each worker running with its pid, the step.
    status = run.wait_for(lambda s: s["step"] >= 3 and s["state"] == "running"
                          and all(w["state"] == "running" for w in s["workers"].values()), timeout=180)
    assert status["pid"] == run.process.pid
    worker_pids = [w["pid"] for w in status["workers"].values()]
    assert len(worker_pids) == 4 and all(pid_alive(pid) for pid in worker_pids)
    later = run.wait_for(lambda s: s["step"] > status["step"], timeout=60)
    assert later["loss"] is not None and later["tokens_per_s"] > 0

    os.killpg(run.pgid, signal.SIGTERM)
    assert run.wait(timeout=120) == 0, run.log_path.read_text()[-3000:]
    final = run.status()
    assert final["state"] == "stopped"
    assert final["last_checkpoint"].endswith(f"step-{final['step']:08d}")
    assert latest_checkpoint(run.output_dir).name == f"step-{final['step']:08d}"
    events = run.events()
    names = [(e["event"], e.get("worker")) for e in events]
    # Drafter 0 checkpoints before it reports its stop; every worker exits with status 0.
    assert names.index(("checkpoint", "drafter0")) < names.index(("stop", "drafter0"))
    assert sorted(e["worker"] for e in events if e["event"] == "worker_exit" and e["returncode"] == 0) == [
        "drafter0", "drafter1", "target0", "target1"]
    assert wait_for(lambda: not any(pid_alive(pid) for pid in worker_pids))
    assert not run.group_alive()

    # The checkpoint holds each drafter's random state and each resumes from its own: on documents
    # of different lengths the losses are the uninterrupted run's, step for step.
    stopped_at = final["step"]
    assert 3 <= stopped_at < steps
    assert len(load_checkpoint(latest_checkpoint(run.output_dir))[1]["rng"]) == 2
    resumed = start_run(write_config("term", **sections))
    assert resumed.wait(timeout=240) == 0, resumed.log_path.read_text()[-3000:]
    resumes = [e for e in resumed.events() if e["event"] == "resume"]
    assert [(e["step"], e["saved_ranks"]) for e in resumes] == [(stopped_at, 2)]
    assert step_losses(events) + step_losses(resumed.events()) == expected


@pytest.mark.slow
def test_a_crashing_worker_stops_the_run_with_its_error(write_config, start_run):
    run = start_run(write_config("crash", optim={"total_steps": 10_000},
                                 pipeline={**PIPELINE, "max_restarts": 0}),
                    env={"DFLASH_TEST_FAIL_AT": "target1:2"})
    started = time.monotonic()
    assert run.wait(timeout=180) == 1
    log = run.log_path.read_text()
    assert "injected failure in target1 at 2" in log
    errors = [e for e in run.events() if e["event"] == "error" and "worker target1" in e.get("message", "")]
    assert errors and "injected failure" in errors[0]["message"]
    status = run.status()
    assert status["state"] == "failed" and "worker target1" in status["error"]
    assert "injected failure" in status["error"]
    assert not run.group_alive()
    assert time.monotonic() - started < 170



def wait_for_event(run, predicate, timeout: float = 120) -> tuple[int, dict]:
    """(index, event) of the first event of the run's log that satisfies `predicate(index, event)`."""
    def found():
        event = next(((i, e) for i, e in enumerate(run.events()) if predicate(i, e)), None)
        return event or (run.process.poll() is not None and "exited")

    event = wait_for(found, timeout, interval=0.1)
    if not isinstance(event, tuple):
        log = run.log_path.read_text()[-3000:]
        raise AssertionError(f"no such event (exit {run.process.poll()}):\n{log}")
    return event


def after(index: int, event: str):
    """A predicate for `wait_for_event`: the first `event` after position `index` of the log."""
    return lambda i, e: i > index and e["event"] == event


# Under make test-reliability only (a minute): tests/reliability/test_worker_kills.py kills workers at
# random moments at full count; make test keeps a crashing worker's stop (the test above).
@pytest.mark.slow
@pytest.mark.reliability_full
def test_a_killed_worker_restarts_the_group_from_the_checkpoint_until_the_limit(
        write_config, start_run, pid_alive):
    config = write_config("restarts", optim={"total_steps": 10_000}, run={"save_every": 2, "step_delay": 0.1},
                          pipeline={**PIPELINE, "max_restarts": 2})
    run = start_run(config)
    since = -1  # events after this position belong to the current start of the group (its restart event)
    # SIGKILL, as an OOM kill would: a target, then the drafter, then a target once the limit is spent.
    for restart, victim in enumerate(["target0", "drafter0", "target1"]):
        index, _ = wait_for_event(run, after(since, "checkpoint"))
        wait_for_event(run, after(index, "step"))
        start = next(e for e in run.events()
                     if e["event"] == "worker_start" and e["worker"] == victim and e["restart"] == restart)
        os.kill(start["pid"], signal.SIGKILL)
        if restart == 2:
            break
        since, _ = wait_for_event(run, after(index, "restart"))
        resumed_at, resume = wait_for_event(run, after(since, "resume"))
        events = run.events()
        saved = [e["step"] for e in events[:resumed_at] if e["event"] == "checkpoint"]
        assert resume["step"] == max(saved) and resume["checkpoint"].endswith(f"step-{max(saved):08d}")
        _, first = wait_for_event(run, after(resumed_at, "step"))
        assert first["step"] == resume["step"] + 1
        assert [e["restart"] for e in events if e["event"] == "restart"] == list(range(1, restart + 2))

    assert run.wait(timeout=120) == 1, run.log_path.read_text()[-3000:]
    status = run.status()
    assert status["state"] == "failed" and status["restarts"] == 2
    assert "worker target1" in status["error"] and "SIGKILL" in status["error"], status["error"]
    # Nothing is left: not the launcher's process group, not a worker of any start of the group.
    pids = [e["pid"] for e in run.events() if e["event"] == "worker_start"]
    assert len(pids) == 9
    assert not run.group_alive()
    assert not any(pid_alive(pid) for pid in pids)


TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA GPUs")
def test_the_pipeline_trains_on_two_gpus_with_nccl_bf16_target_and_fp32_master_drafter(
        write_config, start_run):
    run = start_run(write_config("gpus", model={"dtype": "bfloat16"}, optim={"total_steps": 20},
                                 pipeline={"device": "cuda", "drafter_gpus": [0], "target_gpus": [1]}))
    assert run.wait(timeout=240) == 0, run.log_path.read_text()[-3000:]
    events = run.events()
    # Devices from LOCAL_RANK: drafter0 is rank 0 on the layout's first GPU, target0 rank 1 on the next.
    devices = {e["worker"]: e["device"] for e in events if e["event"] == "start"}
    assert devices == {"drafter0": "cuda:0", "target0": "cuda:1"}
    losses = step_losses(events)
    assert len(losses) == 20 and all(loss == loss for loss in losses)
    assert run.status()["state"] == "stopped" and not run.group_alive()
