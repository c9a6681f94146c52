"""A node's reboot under deployed runs (pvesim's reboot: pve-guests.service's stopall, then startall of the
containers with `onboot: 1`). Each run that was live when its container stopped starts again at the
container's boot (the dflash-resume unit), from its last checkpoint: its first step is the saved step + 1,
and status.yml says it was started again after a boot. A run stopped on purpose stays stopped.

pve1 with CT 200 and CT 201 (four GPUs each), both `onboot: 1`, a run deployed in each, and the node's unit
that makes the NVIDIA device nodes at boot (provision.yml's node play; without it no container passing
them through starts: test_device_nodes_after_a_node_reboot.py)."""

import json
from pathlib import Path

import pytest

from tests.reliability.input_support import deployed_fleet
from tests.waiting import wait_for

# Under make test-reliability only: a fleet and two node reboots (3 min); make test keeps the
# boot resumer's rules (live runs resumed under the lock once their GPUs are idle, stopped ones left
# stopped) through tests/modules/test_run_resume.py.
pytestmark = [pytest.mark.sim, pytest.mark.slow, pytest.mark.reliability_full]

CONTAINERS = (200, 201)
LOG = "/var/log/dflash/main.log"
BOOT_DEVICES = Path(__file__).parent / "playbooks" / "boot_devices.yml"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    for fleet in deployed_fleet(tmp_path_factory.mktemp("node-reboot"), nodes=1, containers=CONTAINERS):
        for vmid in CONTAINERS:
            fleet.node_sh(vmid, f"pct set {vmid} --onboot 1")
        assert fleet.play(str(BOOT_DEVICES)).rc == 0
        yield fleet


def events(fleet, vmid):
    found = []
    for line in (fleet.read(vmid, LOG) or "").splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return [e for e in found if isinstance(e, dict) and "event" in e]


def resumed_after(fleet, vmid, pid):
    """(the last step saved before run `pid` started, the step it resumed at, its first step)."""
    log = events(fleet, vmid)
    start = max(i for i, e in enumerate(log) if e["event"] == "start" and e.get("pid") == pid)
    saved = [e["step"] for e in log[:start] if e["event"] == "checkpoint"][-1]
    resume = [e for e in log[:start] if e["event"] == "resume"][-1]
    first = next(e for e in log[start:] if e["event"] == "step")
    return saved, resume["step"], first["step"]


def booted_run(fleet, vmid, before):
    """The pidfile's record once the container's boot started a run other than `before` (a record: a
    container's pids start again from 1 at its boot, the start time tells two runs apart) that logged a
    step."""
    def started():
        record = fleet.run_info(vmid) or {}
        if record.get("started_by") != "boot" or record.get("start_time") == before.get("start_time"):
            return None
        if not fleet.alive(vmid, record["pid"]):
            return None
        log = events(fleet, vmid)
        ran = any(e["event"] == "start" and e.get("pid") == record["pid"] for e in log)
        return record if ran and log[-1]["event"] in ("step", "heldout", "checkpoint") else None
    assert wait_for(started, timeout=180, interval=1), f"CT {vmid}: no run at boot: {fleet.run_info(vmid)}"
    return started()


def status_table(fleet):
    res = fleet.play("status.yml")
    assert res.rc == 0, res
    return "\n".join(str(r.get("msg")) for _, _, r in res.host_results() if "msg" in r)


def test_a_reboot_resumes_every_run_that_was_live_at_saved_step_plus_one(fleet):
    assert fleet.play("deploy.yml").rc == 0
    before = {vmid: fleet.run_info(vmid) for vmid in CONTAINERS}
    for vmid in CONTAINERS:
        fleet.wait_for_checkpoint(vmid)
    log = fleet.sim.reboot_node("pve1")
    assert "Stopping CT 201" in log and "Starting CT 200" in log, log
    for vmid in CONTAINERS:
        record = booted_run(fleet, vmid, before[vmid])
        saved, resumed, first = resumed_after(fleet, vmid, record["pid"])
        # The shutdown's SIGTERM made the run save; the boot's run resumed from that very checkpoint.
        assert resumed == saved and first == saved + 1, (vmid, saved, resumed, first)
        print(f"CT {vmid}: after the reboot, run {record['pid']} resumed at step {saved}, trained {first}")
    table = status_table(fleet)
    assert table.count("after its container's boot") == len(CONTAINERS), table


def test_a_run_stopped_on_purpose_stays_stopped_after_a_reboot(fleet):
    assert fleet.play("deploy.yml").rc == 0
    assert fleet.play("stop_training.yml", "-l", "ct201").rc == 0
    before = fleet.run_info(200)
    fleet.sim.reboot_node("pve1")
    booted_run(fleet, 200, before)
    assert wait_for(lambda: fleet.read(201, "/var/lib/dflash/main.boot-result.json"), timeout=60)
    result = json.loads(fleet.read(201, "/var/lib/dflash/main.boot-result.json"))
    assert result["outcome"] == "stopped" and "on purpose" in result["msg"], result
    assert fleet.run_info(201) is None
    assert fleet.play("deploy.yml", "-l", "ct201").rc == 0  # a deploy starts it, as before
