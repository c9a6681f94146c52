"""`--check --diff` of deploy.yml, restart_training.yml, stop_training.yml and rollback.yml on a deployed
fleet: each runs to the end, says what it would change (a new release, a restart, a stop, a rollback) and
changes nothing: the run's pid and pidfile, the releases, `current` and `previous` are the same after."""

import json

import pytest
import yaml

from pvesim.fleet import REPO, Fleet, change_code

pytestmark = [pytest.mark.sim, pytest.mark.slow]

CONTAINERS = (200,)
CHECK = ("--check", "--diff")
RELEASE_TASK = "Ensure the release is live in the container (unpacked and validated before the switch)."
STOP_TASK = "Stop the run (the trainer checkpoints on SIGTERM)."
# A restart's one call (stop, GPUs idle, start); in check mode it only says what it would stop.
RESTART_TASK = "Start the run once its GPUs are idle, and wait for its first training step."
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
    return {host for host, result in res.results(RESTART_TASK).items()
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
