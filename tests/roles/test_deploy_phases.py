"""deploy.yml's phases as tags (its header): -t preflight and -t verify change nothing, -t release makes a
new release live while the run keeps its process, -t verify then fails naming the restart, and -t restart
moves the run onto the live release without shipping anything. And a start's wait for its first step
says how far the run got at each poll. The tests share one fleet, in order."""

import json

import pytest

from pvesim.fleet import Fleet, change_code

pytestmark = [pytest.mark.sim, pytest.mark.slow]

VMID = 200
HOST = f"ct{VMID}"
NODE_TASK = "Check the container on its Proxmox node."
RELEASE_TASK = "Ensure the release is live in the container (unpacked and validated before the switch)."
VERIFY_TASK = "Fail clearly when the run is not up on the live release."
START_TASK = "Start the run once its GPUs are idle, and wait for its first training step."
WAIT_TASK = "Wait for the run's first training step."


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("phases-fleet"), nodes=1, containers=(VMID,))
    res = f.play("deploy.yml")
    assert res.rc == 0, res
    yield f
    f.down()


def state(fleet):
    info = fleet.run_info(VMID)
    return {"pid": info["pid"], "alive": fleet.alive(VMID, info["pid"]), "release": fleet.live_release(VMID),
            "releases": fleet.ct(VMID, "ls /opt/dflash/releases").stdout.split()}


def ran(res):
    """The names of the tasks that ran (not skipped) on the container."""
    return {task.name.rsplit(" : ", 1)[-1] for task in res.tasks
            if HOST in task.hosts and not task.hosts[HOST].get("skipped")}


def test_preflight_and_verify_alone_check_and_change_nothing(fleet):
    before = state(fleet)
    assert before["alive"], before
    change_code(fleet.src, "pending")  # a release -t preflight and -t verify must not ship
    preflight = fleet.play("deploy.yml", "-t", "preflight")
    assert preflight.rc == 0, preflight
    assert NODE_TASK in ran(preflight) and RELEASE_TASK not in ran(preflight), ran(preflight)
    verify = fleet.play("deploy.yml", "-t", "verify")
    assert verify.rc == 0, verify
    assert VERIFY_TASK in ran(verify) and {NODE_TASK, RELEASE_TASK, START_TASK}.isdisjoint(ran(verify))
    assert verify.stats[HOST]["changed"] == preflight.stats[HOST]["changed"] == 0
    assert state(fleet) == before


def test_release_alone_makes_it_live_and_leaves_the_run_on_its_process(fleet):
    before = state(fleet)
    res = fleet.play("deploy.yml", "-t", "release")
    assert res.rc == 0, res
    assert res.results(RELEASE_TASK)[HOST]["changed"] and START_TASK not in ran(res)
    after = state(fleet)
    assert after["release"] != before["release"]
    assert (after["pid"], after["alive"]) == (before["pid"], True)
    # The run now runs another release than the live one: -t verify says so, and how to fix it.
    verify = fleet.play("deploy.yml", "-t", "verify")
    assert verify.rc != 0
    message = verify.results(VERIFY_TASK)[HOST]["msg"]
    live = after["release"].rsplit("/", 1)[-1]
    assert "restart_training.yml -l ct200" in message and live in message, message


def test_restart_alone_moves_the_run_onto_the_live_release_and_ships_nothing(fleet):
    before = state(fleet)
    res = fleet.play("deploy.yml", "-t", "restart")
    assert res.rc == 0, res
    assert RELEASE_TASK not in ran(res) and res.results(START_TASK)[HOST]["changed"]
    after = state(fleet)
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
    started, waited = res.results(START_TASK)[HOST], res.results(WAIT_TASK)[HOST]
    assert started["matched"] is False and waited["matched"] is True, (started, waited)
    assert json.loads(waited["progress"])["event"] == "step", waited
    assert f"{HOST}: still waiting; last: " in res.stdout, res.stdout[-3000:]
    assert fleet.alive(VMID, started["pid"])
