"""A worker of a deployed run SIGKILLed again and again at random moments, as OOM kills would.

CT 200 runs the sim's run with a 1 + 1 worker layout under torchrun, deployed by `deploy.yml` with a
restart limit above the number of kills. Each kill picks a worker of the current start of the group
at random and a random moment after the group logged its first step. After each kill torchrun
restarts the group, which resumes from the newest complete checkpoint on disk and logs its step + 1 first.
That checkpoint is no older than the last one the log names, and may be newer: the checkpoint is written
on a thread and its `checkpoint` line logged at the next step boundary, so a kill in between leaves a
complete checkpoint the log never named. The test reads the checkpoints on disk once the new group has
started (its first `worker_start`, when every worker of the old one is gone and no new save can have come:
the next one is `save_every` steps later);
there is always exactly one run (the pidfile's launcher, one torchrun and its two workers: never two,
never a worker of an earlier start). At the end a deploy converges and keeps the run.

Runs under `make test-reliability` only (20 kills); tests/pipeline/test_pipeline_run.py kills a worker
until the limit is spent.
"""

import json
import time

import pytest
import yaml

from pvesim.fleet import SIM_GROUP_VARS, Fleet
from tests.reliability.stops_support import rng_for, trainer_processes
from tests.reliability.trial_counts import trials
from tests.waiting import wait_for

pytestmark = [pytest.mark.sim, pytest.mark.slow, pytest.mark.reliability_full]

VMID = 200
KILLS = trials(2, 20)
LOG = "/var/log/dflash/main.log"
RESTART_TIMEOUT_S = 240
CHECKPOINTS = "/var/lib/dflash/runs/main/checkpoints"  # the sim's dflash_release_output_dir
# The complete checkpoints (dflash_ops.training.checkpoint.list_checkpoints: a step-N directory with its
# four files; a write in progress is a .tmp- directory), one step a line.
COMPLETE_CHECKPOINTS = (f"for d in {CHECKPOINTS}/step-*; do [ -f $d/model.safetensors ] && "
                        "[ -f $d/trainer.pt ] && [ -f $d/config.yaml ] && [ -f $d/meta.json ] && "
                        "echo ${d##*/step-}; done; true")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("worker-kills"), nodes=1, containers=(VMID,), gpus=2)
    try:
        settings = yaml.safe_load((SIM_GROUP_VARS / "training_containers.yml").read_text())
        settings = settings["dflash_release_settings"]
        settings["data"].pop("eval_path")  # no held-out evaluation: a quicker start
        settings["run"]["save_every"] = 3
        settings["pipeline"].update(target_workers=1, drafter_workers=1)
        f.host_vars(f"ct{VMID}", {"dflash_release_settings": settings, "dflash_run_max_restarts": KILLS + 5,
                                  "dflash_run_progress_timeout": 300})
        res = f.play("deploy.yml")
        assert res.rc == 0, str(res)
        yield f
    finally:
        f.down()


def events(fleet):
    return [json.loads(line) for line in (fleet.read(VMID, LOG) or "").splitlines() if line.startswith("{")]


def group_started(log, restart):
    """The workers of start `restart` of the group ({name: pid}), once its first step is logged after
    its resume (or its first start's first step); else None."""
    starts = [i for i, e in enumerate(log) if e["event"] == "worker_start" and e.get("restart") == restart]
    if not starts:
        return None
    later = log[starts[0]:]
    if not any(e["event"] == "step" for e in later):
        return None
    return {e["worker"]: e["pid"] for e in later
            if e["event"] == "worker_start" and e.get("restart") == restart}


def poll(read, timeout=RESTART_TIMEOUT_S):
    """What `read()` returns once it returns something, or None after `timeout`."""
    return wait_for(read, timeout, interval=0.5) or None


def assert_one_run(fleet, launcher):
    assert fleet.run_info(VMID)["pid"] == launcher and fleet.alive(VMID, launcher)
    # The launcher, one torchrun and two workers: nothing of an earlier start is left.
    processes = trainer_processes(fleet, VMID)
    assert len(processes) == 4, processes


def test_a_worker_killed_again_and_again_resumes_each_time_and_leaves_one_run(fleet):
    rng, _ = rng_for("worker kills")
    launcher = fleet.run_info(VMID)["pid"]
    workers = poll(lambda: group_started(events(fleet), 0))
    # A checkpoint first, so that every kill has one to resume from.
    assert poll(lambda: any(e["event"] == "checkpoint" for e in events(fleet))), "no checkpoint"
    print(f"{'kill':>4}  {'worker':<8}  {'delay s':>7}  {'logged':>6}  {'on disk':>7}  {'resumed':>7}  "
          "first step")
    for kill in range(KILLS):
        assert workers, f"start {kill} of the group logged no step"
        delay = round(rng.uniform(0.0, 4.0), 2)
        time.sleep(delay)  # the fault's random moment (a time, not a condition)
        victim = rng.choice(sorted(workers))
        before = len(events(fleet))
        fleet.ct(VMID, f"kill -9 {workers[victim]}")
        restarted = poll(lambda restart=kill + 1, before=before: any(
            e["event"] == "restart" and e["restart"] == restart for e in events(fleet)[before:]))
        assert restarted, f"kill {kill + 1}: torchrun did not restart the group"
        on_disk = max(int(line) for line in fleet.ct(VMID, COMPLETE_CHECKPOINTS).stdout.split())
        found = poll(lambda restart=kill + 1: group_started(events(fleet), restart))
        log = events(fleet)
        assert found, f"kill {kill + 1}: no restart of the group with a step; log ends {log[-5:]}"
        after = log[before:]
        restart_at = next(i for i, e in enumerate(after) if e["event"] == "restart")
        resume = next(e for e in after[restart_at:] if e["event"] == "resume")
        first_step = next(e for e in after[restart_at:] if e["event"] == "step")
        saved = max(e["step"] for e in log[:before + restart_at] if e["event"] == "checkpoint")
        print(f"{kill + 1:>4}  {victim:<8}  {delay:>7}  {saved:>6}  {on_disk:>7}  {resume['step']:>7}  "
              f"{first_step['step']}")
        assert on_disk >= saved  # a checkpoint the log names is on disk
        assert resume["step"] == on_disk and first_step["step"] == on_disk + 1
        assert_one_run(fleet, launcher)
        workers = found
    status = fleet.status(VMID)
    assert status["restarts"] == KILLS and status["state"] == "running", status

    res = fleet.play("deploy.yml")
    assert res.rc == 0, str(res)
    assert_one_run(fleet, launcher)  # nothing changed: the deploy kept the run
