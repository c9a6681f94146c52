"""The run's log does not fill the disk: provision.yml installs a logrotate rule for it in the container
(proxmox_provision_logrotate, on by default); `logrotate -f` with that rule, inside the container, rotates
a live run's log; the run's next lines are in the new log, every step line from before is in the rotated
one, and the step numbers run on without a gap. The same rule under writers at full speed, without a sim:
tests/roles/test_log_hold.py."""

import json

import pytest

from pvesim.fleet import Fleet
from tests.waiting import wait_for

pytestmark = [pytest.mark.sim, pytest.mark.slow]

LOG = "/var/log/dflash/main.log"
RULE = "/etc/logrotate.d/dflash-main"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("logrotate-fleet"), nodes=1, containers=(200,))
    yield f
    f.down()


def steps(text):
    """The step numbers of the log's `step` events, in the order written."""
    found = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == "step":
            found.append(record["step"])
    return found


def log_steps(fleet):
    return steps(fleet.read(200, LOG) or "")


def test_provision_installs_the_rule_and_a_forced_rotation_of_a_live_run_loses_no_line(fleet):
    res = fleet.play("provision.yml", "-l", "ct200")
    assert res.rc == 0, res
    rule = fleet.read(200, RULE)
    assert rule and f"{LOG} {{" in rule and "copytruncate" in rule and "size 100M" in rule, rule
    again = fleet.play("provision.yml", "-l", "ct200")
    assert again.rc == 0 and not again.changed_tasks(), again.changed_tasks()
    res = fleet.play("deploy.yml")
    assert res.rc == 0, res
    assert wait_for(lambda: len(log_steps(fleet)) >= 2, timeout=180, interval=1), fleet.read(200, LOG)

    rotate = fleet.ct(200, f"logrotate -f {RULE}")
    assert rotate.returncode == 0, rotate.stderr
    rotated = fleet.ct(200, f"gzip -dc {LOG}.1.gz")
    assert rotated.returncode == 0, rotated.stderr
    before = steps(rotated.stdout)
    # The run goes on writing to the same path: its next steps are in the new log.
    assert wait_for(lambda: len(log_steps(fleet)) >= 2, timeout=180, interval=1), fleet.read(200, LOG)
    after = log_steps(fleet)
    assert before and after and after[0] > before[-1], (before, after)
    every = before + after
    interval = every[1] - every[0]
    assert interval > 0 and all(b - a == interval for a, b in zip(every, every[1:], strict=False)), every
    assert fleet.ct(200, f"test -e {LOG}.2.gz || test -e {LOG}.1").returncode != 0
