"""A run across two containers on two nodes (the sim's loopback network), 1 drafter + 1 target worker
in each, deployed and shown as one run through the playbooks.

A restart refused before any member is stopped (a member's venv it must not run) is here; stopping it at one
checkpoint, restarting it, and a member that fails to start are in
tests/reliability/test_member_faults.py (`make test-reliability`), with this module's settings.
The tests share one fleet and run in order, each from the state the previous one left.
"""

import pytest
import yaml

from pvesim.fleet import SIM_GROUP_VARS, Fleet
from tests.ports import rendezvous_port

pytestmark = [pytest.mark.sim, pytest.mark.slow]

CONTAINERS = (210, 211)
HOSTS = [f"ct{v}" for v in CONTAINERS]
MEMBERS = [{"host": host, "drafters": 1, "targets": 1} for host in HOSTS]


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
    for host in HOSTS:
        f.host_vars(host, member_vars(rendezvous_port(f.sim.tag)))
    yield f
    f.down()


def workers(fleet, vmid):
    return sorted(fleet.status(vmid).get("workers", {}))


def test_deploy_starts_one_run_across_both_members(fleet):
    res = fleet.play("deploy.yml")
    assert res.rc == 0, res
    # Both started in one task, each waiting for its own first step (global ranks member by member).
    started = res.results("Start the run once its GPUs are idle, and wait for its first training step.")
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


def test_a_restart_one_member_would_refuse_is_refused_before_any_member_is_stopped(fleet):
    """CT 211's venv is made writable by its group: its start would be refused, so the restart stops no
    member (it used to stop both, then fail CT 211's start). The first member's check includes the
    rendezvous port (held by the run it would replace, so allowed)."""
    port = yaml.safe_load((fleet.base / "inventory" / "host_vars" / "ct210.yml").read_text())[
        "dflash_run_rendezvous_port"]
    before = [fleet.run_info(v)["pid"] for v in CONTAINERS]
    config = "/opt/dflash/venv/pyvenv.cfg"
    assert fleet.ct(211, f"chmod g+w {config}").returncode == 0
    try:
        res = fleet.play("restart_training.yml")
    finally:
        fleet.ct(211, f"chmod g-w {config}")
    assert res.rc != 0
    checks = res.results("Check that the run's start would pass its checks (nothing is stopped).")
    assert [checks[h]["invocation"]["module_args"]["free_ports"] for h in HOSTS] == [[port], []], checks
    assert not checks["ct210"].get("failed") and checks["ct211"].get("failed"), checks
    refused = res.results("whose start would be refused, with every member left as it is.")
    assert set(refused) == set(HOSTS), str(res)
    msg = refused["ct210"]["msg"]
    assert "the start would be refused on ct211: ct211:" in msg and config in msg, msg
    assert "Nothing was stopped on any member (ct210, ct211)" in msg
    stops = res.results("Stop the run (the trainer checkpoints on SIGTERM).")
    assert all(r.get("skipped") for r in stops.values()), stops
    assert [fleet.run_info(v)["pid"] for v in CONTAINERS] == before
    assert all(fleet.alive(v, pid) for v, pid in zip(CONTAINERS, before, strict=True))
