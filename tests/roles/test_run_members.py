"""A run across two containers on two nodes (the sim's loopback network), 1 drafter + 1 target worker
in each, deployed, shown, stopped, restarted and resumed as one run through the playbooks; a member
that fails to start stops the other and the play names it.

The tests share one fleet and run in order, each from the state the previous one left.
"""

import socket

import pytest
import yaml

from pvesim.fleet import SIM_GROUP_VARS, Fleet

pytestmark = [pytest.mark.sim, pytest.mark.slow]

CONTAINERS = (210, 211)
HOSTS = [f"ct{v}" for v in CONTAINERS]
MEMBERS = [{"host": host, "drafters": 1, "targets": 1} for host in HOSTS]
BLOCKER = "/var/lib/dflash/runs/main"  # a file here keeps a member's run from writing its output


def member_vars(port):
    """Each member's inventory: the run's declaration, and the sim's settings with a 1 + 1 layout."""
    group_vars = yaml.safe_load((SIM_GROUP_VARS / "training_containers.yml").read_text())
    settings = group_vars["dflash_release_settings"]
    settings["data"].pop("eval_path")  # no held-out evaluation: a quicker start
    settings["pipeline"].update(target_workers=1, drafter_workers=1, max_restarts=0)
    return {
        "dflash_run_members": MEMBERS, "dflash_run_address": "{{ pvesim_address }}",
        "dflash_run_rendezvous_port": port, "dflash_run_rendezvous_timeout": 30,
        # Four workers and two torchruns start on a 2-core machine: a first step takes a while.
        "dflash_run_progress_timeout": 300,
        "dflash_release_settings": settings,
        # The members' interface on the sim's loopback network (on a real LAN: its NIC).
        "dflash_release_environment": {"CUDA_VISIBLE_DEVICES": "0,1", "GLOO_SOCKET_IFNAME": "lo"},
    }


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("members-fleet"), nodes=2, containers=CONTAINERS, gpus=2,
              network="loopback")
    with socket.socket() as s:
        s.bind((f.sim.address_of(CONTAINERS[0]), 0))
        port = s.getsockname()[1]
    for host in HOSTS:
        f.host_vars(host, member_vars(port))
    yield f
    f.down()


def workers(fleet, vmid):
    return sorted(fleet.status(vmid).get("workers", {}))


def events(fleet, vmid, name):
    log = fleet.read(vmid, "/var/log/dflash/main.log") or ""
    return [r for r in map(yaml.safe_load, (line for line in log.splitlines() if line.startswith("{")))
            if r.get("event") == name]


def test_deploy_starts_one_run_across_both_members(fleet):
    res = fleet.play("deploy.yml")
    assert res.rc == 0, res
    # Both started in one task, each waiting for its own first step (global ranks member by member).
    started = res.results("Start the run from the live release and wait for its first training step.")
    assert set(started) == set(HOSTS)
    assert [workers(fleet, v) for v in CONTAINERS] == [["drafter0", "target0"], ["drafter1", "target1"]]
    assert all(fleet.status(v)["step"] >= 1 for v in CONTAINERS)


def test_status_shows_the_run_as_one_row_with_its_members(fleet):
    res = fleet.play("status.yml")
    assert res.rc == 0, res
    table = next(iter(res.results("Show the fleet's runs.").values()))["msg"]
    rows = [line for line in table[1:] if line.startswith("ct")]
    assert [row.split()[0] for row in rows] == ["ct210"]
    members = next(line for line in table if "members:" in line)
    assert "run main across 2 members:" in members
    for vmid, node in zip(CONTAINERS, ("pve1", "pve2"), strict=True):
        assert f"ct{vmid} ({node}, running, pid {fleet.run_info(vmid)['pid']}," in members


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
        assert [e["step"] for e in events(fleet, vmid, "resume")][-1] == steps[0]
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
    # CT 211 failed on its own (its output dir), CT 210 waited at the rendezvous for it.
    assert "ct211: run exited with code 1" in message and f"Not a directory: '{BLOCKER}/" in message, message
    assert "RendezvousTimeoutError" in message and "Every member (ct210, ct211) is stopped." in message
    assert [fleet.run_info(v) for v in CONTAINERS] == [None, None]
    for vmid in CONTAINERS:  # no worker of either member is left
        assert fleet.ct(vmid, "ps -eo args | grep -c '[d]flash'").stdout.strip() == "0"
    assert fleet.ct(211, f"rm {BLOCKER} && mv {BLOCKER}.aside {BLOCKER}").returncode == 0
