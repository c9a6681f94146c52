"""`--check --diff` of deploy.yml, restart_training.yml, stop_training.yml and rollback.yml on a deployed
fleet: each runs to the end, says what it would change (a new release, a restart, a stop, a rollback) and
changes nothing: the run's pid and pidfile, the releases, `current` and `previous` are the same after.

Then, on the same fleet, deploy.yml's phases as tags (its header): -t preflight and -t verify change
nothing, -t release makes a new release live while the run keeps its process, -t verify then fails naming
the restart, and -t restart moves the run onto the live release without shipping anything; and a start's
wait for its first step, and a restart's wait for a slow stop, say how far they got at each poll. The tests
run in order."""

import json

import pytest
import yaml

from ansible_collections.dflash.ops.plugins.module_utils import run_job
from pvesim.fleet import REPO, Fleet, change_code
from tests.reliability.stops_support import FAKE_RUN, LOG, PIDFILE, training_run

pytestmark = [pytest.mark.sim, pytest.mark.slow]

CONTAINERS = (200,)
CHECK = ("--check", "--diff")
RELEASE_TASK = "Ensure the release is live in the container (unpacked and validated before the switch)."
STOP_TASK = "Stop the run (the trainer checkpoints on SIGTERM)."
# A start's one call; a restart's (stop, GPUs idle, start) as an async job; in check mode a plain call that
# only says what it would stop.
LAUNCH_TASK = "Start the run once its GPUs are idle, and wait for its first training step."
# The wait for a restart's call, which returns its result.
RESTART_TASK = "Wait for the restart's call (its stop, the GPUs' idle wait, the start), saying what it does."
START_TASK = "Report the run this would start (check mode)."


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("check-fleet"), nodes=1, containers=CONTAINERS)
    # Two releases in every container (so rollback has a previous one), the run on the second.
    for marker in ("first", "second"):
        change_code(f.src, marker)
        res = f.play("deploy.yml")
        assert res.rc == 0, res
    yield f
    f.down()


def state(fleet):
    """What a check run must not change, per container."""
    out = {}
    for vmid in CONTAINERS:
        listing = fleet.ct(
            vmid, "ls -a /opt/dflash/releases; readlink /opt/dflash/current /opt/dflash/previous")
        out[vmid] = {"pidfile": fleet.read(vmid, "/var/lib/dflash/main.pid"), "tree": listing.stdout}
        info = fleet.run_info(vmid)
        out[vmid]["alive"] = bool(info) and fleet.alive(vmid, info["pid"])
    return out


def changed(res, task):
    return {host for host, result in res.results(task).items() if result.get("changed")}


def would_stop(res):
    return {host for host, result in res.results(LAUNCH_TASK).items()
            if result.get("changed") and result["msg"].startswith("would stop")}


def everywhere():
    return {f"ct{v}" for v in CONTAINERS}


def test_deploy_in_check_mode_reports_the_new_release_and_the_restart_and_changes_nothing(fleet):
    before = state(fleet)
    assert all(s["alive"] for s in before.values()), before
    change_code(fleet.src, "third")
    res = fleet.play("deploy.yml", *CHECK)
    assert res.rc == 0, res
    assert changed(res, RELEASE_TASK) == everywhere()
    assert would_stop(res) == everywhere()
    assert changed(res, START_TASK) == everywhere()
    assert state(fleet) == before


# Under make test-reliability only (20 s each): make test keeps the deploy's, the stop's and --diff's; a
# restart and a rollback in check mode run the same reports (the start's, the switch's).
@pytest.mark.reliability_full
def test_restart_in_check_mode_reports_the_stop_and_start_and_changes_nothing(fleet):
    before = state(fleet)
    res = fleet.play("restart_training.yml", *CHECK)
    assert res.rc == 0, res
    assert would_stop(res) == everywhere()
    assert changed(res, START_TASK) == everywhere()
    assert state(fleet) == before


def test_stop_in_check_mode_reports_the_stop_and_stops_nothing(fleet):
    before = state(fleet)
    res = fleet.play("stop_training.yml", *CHECK)
    assert res.rc == 0, res
    stops = res.results(STOP_TASK)
    would_stop = {host for host, result in stops.items() if result["msg"].startswith("would stop")}
    assert changed(res, STOP_TASK) == would_stop == everywhere()
    assert state(fleet) == before


@pytest.mark.reliability_full
def test_rollback_in_check_mode_reports_the_switch_and_the_restart_and_changes_nothing(fleet):
    before = state(fleet)
    res = fleet.play("rollback.yml", *CHECK)
    assert res.rc == 0, res
    assert changed(res, RELEASE_TASK) == everywhere()
    assert changed(res, START_TASK) == everywhere()
    assert state(fleet) == before


def test_deploy_diff_shows_the_rendered_config_change_of_a_settings_key(fleet):
    """The most common change, a key of dflash_release_settings, shows under --diff as the rendered
    config.yaml's lines, before and after (and nothing is changed in check mode)."""
    settings = yaml.safe_load((REPO / "inventory/sim/group_vars/training_containers.yml").read_text())[
        "dflash_release_settings"]
    settings["optim"]["lr"] = 1.25e-3
    before = state(fleet)
    res = fleet.play("deploy.yml", *CHECK, "-e", json.dumps({"dflash_release_settings": settings}))
    assert res.rc == 0, res
    for host, result in res.results(RELEASE_TASK).items():
        diffs = {d["after_header"].rsplit("/", 1)[-1]: d for d in result["diff"]}
        assert set(diffs) == {"config.yaml"}, (host, list(diffs))
        old = yaml.safe_load(diffs["config.yaml"]["before"])
        new = yaml.safe_load(diffs["config.yaml"]["after"])
        assert (old["optim"]["lr"], new["optim"]["lr"]) == (3.0e-3, 1.25e-3)
        assert ({k: v for k, v in old.items() if k != "optim"}
                == {k: v for k, v in new.items() if k != "optim"})
    assert "+++ after: /opt/dflash/releases/" in res.stdout
    assert state(fleet) == before


# deploy.yml's phases (tags) and the start's polled wait, on CT 200.
VMID = 200
HOST = f"ct{VMID}"
NODE_TASK = "Check the container on its Proxmox node."
VERIFY_TASK = "Fail clearly when the run is not up on the live release."
WAIT_TASK = "Wait for the run's first training step."


def phase_state(fleet):
    info = fleet.run_info(VMID)
    return {"pid": info["pid"], "alive": fleet.alive(VMID, info["pid"]), "release": fleet.live_release(VMID),
            "releases": fleet.ct(VMID, "ls /opt/dflash/releases").stdout.split()}


def ran(res):
    """The names of the tasks that ran (not skipped) on the container."""
    return {task.name.rsplit(" : ", 1)[-1] for task in res.tasks
            if HOST in task.hosts and not task.hosts[HOST].get("skipped")}


def test_preflight_and_verify_alone_check_and_change_nothing(fleet):
    before = phase_state(fleet)
    assert before["alive"], before
    change_code(fleet.src, "pending")  # a release -t preflight and -t verify must not ship
    preflight = fleet.play("deploy.yml", "-t", "preflight")
    assert preflight.rc == 0, preflight
    assert NODE_TASK in ran(preflight) and RELEASE_TASK not in ran(preflight), ran(preflight)
    verify = fleet.play("deploy.yml", "-t", "verify")
    assert verify.rc == 0, verify
    assert VERIFY_TASK in ran(verify)
    assert {NODE_TASK, RELEASE_TASK, LAUNCH_TASK, RESTART_TASK}.isdisjoint(ran(verify))
    assert verify.stats[HOST]["changed"] == preflight.stats[HOST]["changed"] == 0
    assert phase_state(fleet) == before


def test_release_alone_makes_it_live_and_leaves_the_run_on_its_process(fleet):
    before = phase_state(fleet)
    res = fleet.play("deploy.yml", "-t", "release")
    assert res.rc == 0, res
    assert res.results(RELEASE_TASK)[HOST]["changed"] and LAUNCH_TASK not in ran(res)
    after = phase_state(fleet)
    assert after["release"] != before["release"]
    assert (after["pid"], after["alive"]) == (before["pid"], True)
    # The run now runs another release than the live one: -t verify says so, and how to fix it.
    verify = fleet.play("deploy.yml", "-t", "verify")
    assert verify.rc != 0
    message = verify.results(VERIFY_TASK)[HOST]["msg"]
    live = after["release"].rsplit("/", 1)[-1]
    assert "restart_training.yml -l ct200" in message and live in message, message


def test_restart_alone_moves_the_run_onto_the_live_release_and_ships_nothing(fleet):
    before = phase_state(fleet)
    res = fleet.play("deploy.yml", "-t", "restart")
    assert res.rc == 0, res
    assert RELEASE_TASK not in ran(res) and res.results(RESTART_TASK)[HOST]["changed"]
    # The wait for the restart's call ended with the call, not at its next poll (dflash_run_progress_poll 30).
    [wait] = [task for task in res.tasks if task.name.endswith(RESTART_TASK)]
    assert wait.hosts[HOST]["attempts"] == 1 and wait.seconds < 30, (wait.seconds, wait.hosts[HOST])
    after = phase_state(fleet)
    assert after["pid"] != before["pid"] and after["alive"]
    assert (after["release"], after["releases"]) == (before["release"], before["releases"])
    verify = fleet.play("deploy.yml", "-t", "verify")
    assert verify.rc == 0, verify


def test_a_first_step_slower_than_the_poll_is_waited_for_with_a_line_at_each_poll(fleet):
    """dflash_run_progress_poll 1 s (30 by default) and no settling: the start's call hands the wait over
    to the polled status, which prints the run's last log line (dflash.ops.waits) until the step."""
    fast = {"dflash_run_progress_poll": 1, "dflash_run_settle_seconds": 0}
    res = fleet.play("restart_training.yml", "-e", json.dumps(fast))
    assert res.rc == 0, res
    started, waited = res.results(RESTART_TASK)[HOST], res.results(WAIT_TASK)[HOST]
    assert started["matched"] is False and waited["matched"] is True, (started, waited)
    assert json.loads(waited["progress"])["event"] == "step", waited
    assert f"{HOST}: still waiting; last: " in res.stdout, res.stdout[-3000:]
    assert fleet.alive(VMID, started["pid"])


STOP_LINES = 2  # lines of the restart's wait naming the stop that the test reads before the stop may end
RELEASE = "/tmp/dflash-test-release"  # in the container: the stand-in run's checkpoint ends once it exists


def test_a_restarts_stop_slower_than_the_poll_says_what_it_waits_for_at_each_poll(fleet):
    """A run that checkpoints on SIGTERM until RELEASE exists (the tests' stand-in, under the role's pidfile
    and log, holding the run's GPUs), restarted with dflash_run_progress_poll 1: the restart's one call runs
    as an async job, and its wait prints a line at each poll naming the stop of that pid with the log's last
    line (the checkpoint's); the test creates RELEASE once it has read STOP_LINES of them, so the stop lasts
    as long as the machine needs. The wait then returns the call's result; the new run starts."""
    fleet.ct(VMID, f"rm -f {RELEASE}")
    slow = training_run(fleet, VMID, name="main", pidfile=PIDFILE, log_path=LOG, state="restarted",
                        command=["/usr/bin/python3", FAKE_RUN, "--hold-term", RELEASE],
                        environment={"CUDA_VISIBLE_DEVICES": "0,1"}, stop_timeout=60)
    assert not slow.get("failed") and fleet.alive(VMID, slow["pid"]), slow
    stop = f"{HOST}: still waiting for {run_job.stop_phase(slow['pid'], 60)}"  # the sim's stop timeout
    seen = []

    def release_after_the_lines(event):
        seen.extend(line for line in event.get("stdout", "").splitlines()
                    if line.lstrip().startswith(stop) and "; last: fake run: saving the checkpoint" in line)
        if len(seen) >= STOP_LINES and not released:
            released.append(fleet.ct(VMID, f"touch {RELEASE}").returncode)

    released = []
    res = fleet.play("restart_training.yml", "-e", json.dumps({"dflash_run_progress_poll": 1}),
                     on_event=release_after_the_lines)
    assert res.rc == 0 and released == [0], (released, res)
    restarted = res.results(RESTART_TASK)[HOST]
    assert restarted["previous_pid"] == slow["pid"] and restarted["how"] == "terminated", restarted
    assert restarted["gpu_idle"]["met"], restarted
    # During the stop: a line at each poll, naming it, with the checkpoint's last log line.
    lines = [line for line in res.stdout.splitlines() if f"{HOST}: still waiting" in line]
    during_stop = [line for line in lines if line.lstrip().startswith(stop)]
    assert len(during_stop) >= STOP_LINES, res.stdout[-4000:]
    assert all("; last: fake run: saving the checkpoint" in line for line in during_stop), during_stop
    # No flood: no more of the wait's lines than the seconds it waited (one per poll).
    [wait] = [task for task in res.tasks if task.name.endswith(RESTART_TASK)]
    mine = [line for line in lines if "still waiting for " in line]  # the first step's wait names nothing
    assert len(mine) <= wait.seconds + 1, (wait.seconds, mine)
    new = fleet.run_info(VMID)
    assert new["pid"] == restarted["pid"] != slow["pid"] and fleet.alive(VMID, new["pid"])
    assert not fleet.alive(VMID, slow["pid"])
