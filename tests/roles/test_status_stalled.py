"""status.yml knows a stalled run: a live run that took no step for longer than
dflash_status_stalled_after shows `stalled` with its step's age, and dflash_status_fail_on fails the
playbook naming it (a cron job's alert without Prometheus). An unknown state to fail on is refused before
anything runs."""

import pytest

from pvesim.fleet import Fleet
from tests.waiting import wait_for

pytestmark = [pytest.mark.sim, pytest.mark.slow]

STATUS = "/var/lib/dflash/runs/main/status.json"
TABLE = "Show the fleet's runs."


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("stalled-fleet"), nodes=1, containers=(200,))
    res = f.play("deploy.yml")
    assert res.rc == 0, res
    yield f
    f.down()


def status_age(fleet):
    """Seconds since the run last wrote status.json, by the container's clock."""
    out = fleet.ct(200, f"echo $(( $(date +%s) - $(stat -c %Y {STATUS}) ))")
    return int(out.stdout) if out.returncode == 0 else -1


def test_an_unknown_state_to_fail_on_is_refused_before_anything_runs(fleet):
    res = fleet.play("status.yml", "-e", "dflash_status_fail_on=stalled,dead")
    assert res.rc != 0
    assert "dflash_status_fail_on names unknown state(s) dead" in res.messages(), res.messages()
    assert res.results(TABLE) == {} and res.results("Read the run's state, its status.json, the live "
                                                   "release and its GPUs.") == {}


def test_a_frozen_run_shows_stalled_and_fails_the_playbook_naming_it(fleet):
    assert wait_for(lambda: fleet.status(200).get("state") == "running" and fleet.status(200).get("step"),
                    timeout=180, interval=1), f"the run takes no step: {fleet.status(200)}"
    res = fleet.play("status.yml", "-e", "dflash_status_fail_on=stalled,died,failed")
    assert res.rc == 0, res  # a running run fails nothing
    row = next(line for line in next(iter(res.results(TABLE).values()))["msg"] if line.startswith("ct200"))
    assert row.split()[3] == "running" and row.split()[6].endswith("s"), row
    run = fleet.run_info(200)
    assert fleet.ct(200, f"kill -STOP -{run['pgid']}").returncode == 0
    try:
        assert wait_for(lambda: status_age(fleet) >= 4, timeout=60, interval=1)
        res = fleet.play("status.yml", "-e", "dflash_status_stalled_after=3",
                         "-e", "dflash_status_fail_on=stalled")
        assert res.rc != 0, res
        table = next(iter(res.results(TABLE).values()))["msg"]
        row = next(line for line in table if line.startswith("ct200")).split()
        assert (row[3], row[4]) == ("stalled", str(run["pid"])) and int(row[6][:-1]) >= 4, table
        assert any(line.strip().startswith("stalled: live, but no step for") for line in table), table
        assert "Runs in a state of dflash_status_fail_on: ct200 stalled" in res.messages(), res.messages()
    finally:
        assert fleet.ct(200, f"kill -CONT -{run['pgid']}").returncode == 0
    # Running again: it steps on, and the same call passes.
    step = fleet.status(200)["step"]
    assert wait_for(lambda: fleet.status(200).get("step", 0) > step, timeout=120, interval=1)
    res = fleet.play("status.yml", "-e", "dflash_status_stalled_after=60",
                     "-e", "dflash_status_fail_on=stalled")
    assert res.rc == 0, res
