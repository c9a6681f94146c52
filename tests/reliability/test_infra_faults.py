"""Infrastructure faults under a deployed fleet: a container that stops, a node that becomes
unreachable, a node whose host key changes. Each gives a clear error, leaves nothing half-done, and
a rerun recovers once the fault is gone.

One fleet for the module: pve1 with CT 200, pve2 with CT 201, a run in each (deployed once). All of
it runs under `make test-reliability` only (`make test` checks host keys in test_security.py).
"""

import json

import pytest

from pvesim.fleet import change_code
from tests.reliability.input_support import RunSnapshot, deployed_fleet, shown, unreachable

pytestmark = [pytest.mark.sim, pytest.mark.slow]

CONTAINERS = (200, 201)
LOG = "/var/log/dflash/main.log"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    yield from deployed_fleet(tmp_path_factory.mktemp("infra-faults"), nodes=2, containers=CONTAINERS)


def snapshots(fleet):
    return {vmid: RunSnapshot.take(fleet, vmid) for vmid in CONTAINERS}


def on_live_release(fleet, vmid):
    """The run of `vmid` is alive and runs the live release."""
    run = RunSnapshot.take(fleet, vmid)
    return run.alive and run.argv == (f"{run.release}/run.sh",)


def events(fleet, vmid):
    return [json.loads(line) for line in (fleet.read(vmid, LOG) or "").splitlines() if line.startswith("{")]


def checkpoint_step(status):
    return int(status["last_checkpoint"].rstrip("/").rsplit("-", 1)[1])


@pytest.mark.reliability_full
def test_a_stopped_container_fails_clearly_and_a_rerun_resumes_the_run(fleet):
    saved = checkpoint_step(fleet.wait_for_checkpoint(200))
    before = snapshots(fleet)
    fleet.node_sh(200, "pct stop 200")
    res = fleet.play("restart_training.yml", "-l", "ct200")
    assert res.rc != 0, str(res)
    message = shown(res)
    assert "CT 200 on node pve1 is not running" in message and "Start it with `pct start 200`" in message
    # Nothing half-done: the container was not started behind the operator's back, CT 201 was not touched.
    assert fleet.node_sh(200, "pct status 200") == "status: stopped\n"
    assert RunSnapshot.take(fleet, 201) == before[201]

    # Its boot starts the run again (dflash-resume: it was live when its container stopped); a deploy
    # then finds it running the live release and keeps it.
    assert fleet.start_container(200)["outcome"] == "resumed"
    res = fleet.play("deploy.yml", "-l", "ct200")
    assert res.rc == 0, str(res)
    assert on_live_release(fleet, 200) and RunSnapshot.take(fleet, 200).release == before[200].release
    # The new run resumed from the checkpoint the killed one had saved, and trains on from there.
    new_pid = fleet.run_info(200)["pid"]
    log = events(fleet, 200)
    start = max(i for i, e in enumerate(log) if e["event"] == "start" and e.get("pid") == new_pid)
    resumed = [e for e in log[:start] if e["event"] == "resume"]
    assert resumed and resumed[-1]["step"] >= saved > 0, log[start - 3:start + 2]
    assert log[start]["step"] == resumed[-1]["step"]
    assert RunSnapshot.take(fleet, 201) == before[201]


@pytest.mark.reliability_full
def test_an_unreachable_node_stops_the_rollout_and_a_rerun_converges(fleet):
    before = snapshots(fleet)
    change_code(fleet.src, "node outage")
    fleet.sim.stop_node("pve2")
    try:
        res = fleet.play("deploy.yml")  # the default rollout: ct200 alone first, then the rest
    finally:
        fleet.sim.start_node("pve2")
    assert res.rc != 0, str(res)
    lost = unreachable(res)
    assert lost.startswith("ct201: UNREACHABLE") and "Connection refused" in lost, shown(res)
    # ct200 (pve1) was deployed completely: the new release is live and its run runs it.
    assert fleet.live_release(200) != before[200].release and on_live_release(fleet, 200)
    # ct201 (pve2) was not half-deployed: its run and its release are as they were.
    assert RunSnapshot.take(fleet, 201) == before[201]

    res = fleet.play("deploy.yml")
    assert res.rc == 0, str(res)
    assert fleet.live_release(201) == fleet.live_release(200) != before[201].release
    assert on_live_release(fleet, 201)


@pytest.mark.reliability_full
def test_a_changed_host_key_is_refused_until_known_hosts_is_updated(fleet):
    before = snapshots(fleet)
    fleet.sim.rotate_host_key("pve1")
    try:
        res = fleet.play("restart_training.yml", "-l", "ct200")
        # The container's own connection (paramiko, reading the system known_hosts) refuses it too.
        ping = fleet.adhoc("ct200", "-m", "ansible.builtin.ping")
    finally:
        fleet.sim.trust_host_keys()  # what the operator does after checking the new key
    assert res.rc != 0, str(res)
    message = shown(res)
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in message or "Host key verification failed" in message
    assert ping.returncode != 0 and "host key mismatch for 127.0.0.2" in ping.stdout, ping.stdout
    assert snapshots(fleet) == before  # nothing was touched

    res = fleet.play("restart_training.yml", "-l", "ct200")
    assert res.rc == 0, str(res)
    after = snapshots(fleet)
    assert after[200].pid != before[200].pid and on_live_release(fleet, 200)
    assert after[201] == before[201]
