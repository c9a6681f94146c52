"""The run's held-out figures reach the operator: status.yml's table shows the latest held-out tau,
and fetch_metrics.yml brings every container's metrics.jsonl to the controller and draws the fleet's
loss and tau curves there."""

import re

import pytest

from pvesim.fleet import Fleet
from tests.waiting import wait_for

pytestmark = [pytest.mark.sim, pytest.mark.slow]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("metrics-fleet"), nodes=1, containers=(200,))
    res = f.play("deploy.yml")
    assert res.rc == 0, res
    yield f
    f.down()


def wait_for_heldout(fleet, vmid, timeout=180):
    status = wait_for(lambda: (s := fleet.status(vmid)).get("heldout_tau") is not None and s,
                      timeout, interval=1)
    if status:
        return status
    pytest.fail(f"CT {vmid}: no held-out evaluation within {timeout} s; status {fleet.status(vmid)}")


def test_status_shows_the_latest_heldout_tau(fleet):
    status = wait_for_heldout(fleet, 200)
    res = fleet.play("status.yml")
    assert res.rc == 0, res
    table = next(iter(res.results("Show the fleet's runs.").values()))["msg"]
    header, row = table[0].split(), next(line for line in table if line.startswith("ct200"))
    assert "tau" in header
    tau = row.split()[header.index("tau")]
    assert re.fullmatch(r"\d+\.\d\d", tau), row
    # The table's figure is at least as recent as the one read before it (the run goes on).
    assert float(tau) >= 1.0 and status["heldout_tau"] >= 1.0


def test_fetch_metrics_draws_the_fleets_curves_on_the_controller(fleet, tmp_path):
    wait_for_heldout(fleet, 200)
    res = fleet.play("fetch_metrics.yml", "-e", f"dflash_metrics_dir={tmp_path}")
    assert res.rc == 0, res
    fetched = (tmp_path / "ct200.metrics.jsonl").read_text().splitlines()
    assert any('"kind": "heldout"' in line for line in fetched), fetched[-3:]
    for name in ("loss.png", "tau.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
