"""Faults under a run across two containers (pve1 CT 210, pve2 CT 211, the sim's loopback network):
a member container stopped mid-run, a member's node unreachable when a restart begins, a stop and a
restart of the whole run, a member that fails to start. Each ends with one run or none (never two,
never a stray worker), and the next deploy converges.

Runs under `make test-reliability` only (`make test` has tests/roles/test_run_members.py: the deploy
and the status of such a run). The tests share one fleet and run in order.
"""

import json

import pytest

from tests.ports import rendezvous_port
from tests.reliability.input_support import InputFleet
from tests.reliability.stops_support import trainer_processes
from tests.roles.test_run_members import CONTAINERS, HOSTS, member_vars
from tests.waiting import wait_for

pytestmark = [pytest.mark.sim, pytest.mark.slow, pytest.mark.reliability_full]

BLOCKER = "/var/lib/dflash/runs/main"  # a file here keeps a member's run from writing its output


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = InputFleet(tmp_path_factory.mktemp("member-faults"), nodes=2, containers=CONTAINERS, gpus=2,
                   network="loopback")
    for host in HOSTS:
        f.host_vars(host, member_vars(rendezvous_port(f.sim.tag)))
    res = f.play("deploy.yml")
    assert res.rc == 0, str(res)
    yield f
    f.down()


def run_pids(fleet):
    return [(fleet.run_info(v) or {}).get("pid") for v in CONTAINERS]


def resumes(fleet, vmid):
    log = fleet.read(vmid, "/var/log/dflash/main.log") or ""
    return [json.loads(line)["step"] for line in log.splitlines() if '"event": "resume"' in line]


def assert_one_run_on_every_member(fleet):
    assert all(run_pids(fleet)), run_pids(fleet)
    for vmid in CONTAINERS:
        assert fleet.alive(vmid, fleet.run_info(vmid)["pid"])
        # One launcher, one torchrun and two workers: nothing of an earlier start is left.
        assert len(trainer_processes(fleet, vmid)) == 4, trainer_processes(fleet, vmid)


def test_a_member_container_stopped_mid_run_ends_the_run_and_a_deploy_brings_it_back(fleet):
    fleet.wait_for_checkpoint(210)
    fleet.node_sh(211, "pct stop 211")
    # CT 210's workers lose their peers; its torchrun waits at a new rendezvous, then gives up.
    status = fleet.wait_for_status(210, lambda s: s.get("state") == "failed", timeout=180, what="failed run")
    assert status["error"], status
    # No run, no stray worker. status.json's `failed` is the launcher's last write before it exits (its
    # torchrun and workers are gone by then): poll for its exit instead of racing it.
    assert wait_for(lambda: trainer_processes(fleet, 210) == [], timeout=30, interval=0.5), \
        trainer_processes(fleet, 210)

    fleet.node_sh(211, "pct start 211")
    res = fleet.play("deploy.yml")
    assert res.rc == 0, str(res)
    assert_one_run_on_every_member(fleet)
    # Both members resumed from the same checkpoint.
    assert resumes(fleet, 210)[-1] == resumes(fleet, 211)[-1]


def test_a_member_node_unreachable_when_a_restart_begins_leaves_the_run_as_it_is(fleet):
    before = run_pids(fleet)
    fleet.sim.stop_node("pve2")
    try:
        res = fleet.play("restart_training.yml")
        assert res.rc != 0 and res.stats["ct211"]["unreachable"] > 0, str(res)
        # Either the rollout stopped at CT 211's batch, or the members' play refused to touch the run.
        refused = res.results("Fail clearly when a member of the run is not in the play any more.")
        assert not refused or "member(s) ct211 failed earlier in this play" in refused["ct210"]["msg"]
    finally:
        fleet.sim.start_node("pve2")
    # Nothing was stopped or started: the one run goes on, on both members.
    assert run_pids(fleet) == before
    assert_one_run_on_every_member(fleet)
    res = fleet.play("restart_training.yml")
    assert res.rc == 0, str(res)
    assert run_pids(fleet) != before
    assert_one_run_on_every_member(fleet)


def test_stop_stops_every_member_at_one_checkpoint_and_restart_resumes_it(fleet):
    res = fleet.play("stop_training.yml")
    assert res.rc == 0, res
    assert [fleet.run_info(v) for v in CONTAINERS] == [None, None]
    steps = [fleet.status(v)["step"] for v in CONTAINERS]
    assert steps[0] == steps[1] and all(fleet.status(v)["state"] == "stopped" for v in CONTAINERS)
    # Each member keeps its own copy of the checkpoint of the step where the run stopped.
    for vmid in CONTAINERS:
        assert fleet.status(vmid)["last_checkpoint"].endswith(f"step-{steps[0]:08d}")

    res = fleet.play("restart_training.yml")
    assert res.rc == 0, res
    for vmid in CONTAINERS:
        assert resumes(fleet, vmid)[-1] == steps[0]
        assert fleet.status(vmid)["step"] > steps[0]


def test_a_member_that_fails_to_start_stops_the_other_and_is_named(fleet):
    # CT 211's run cannot write its output: its launcher fails at once; CT 210 waits at the rendezvous.
    assert fleet.ct(211, f"mv {BLOCKER} {BLOCKER}.aside && touch {BLOCKER}").returncode == 0
    res = fleet.play("restart_training.yml")
    assert res.rc != 0
    failure = res.results("Fail naming the members that did not start.")
    assert set(failure) == set(HOSTS), res
    message = failure["ct210"]["msg"]
    assert "Run main did not start on ct210, ct211:" in message, message
    # CT 211 refused its output dir (bad input, exit 2), CT 210 waited at the rendezvous for it.
    assert "ct211: run exited with code 2" in message, message
    assert f"run.output_dir: {BLOCKER} is not a directory" in message, message
    assert "RendezvousTimeoutError" in message and "Every member (ct210, ct211) is stopped." in message
    assert [fleet.run_info(v) for v in CONTAINERS] == [None, None]
    for vmid in CONTAINERS:  # no worker of either member is left
        assert fleet.ct(vmid, "ps -eo args | grep -c '[d]flash'").stdout.strip() == "0"
    assert fleet.ct(211, f"rm {BLOCKER} && mv {BLOCKER}.aside {BLOCKER}").returncode == 0
