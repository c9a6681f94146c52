"""The playbooks against the strictest node pvesim makes, in one cycle on one sim:

- Ansible logs in to the node as `ansible`, a user with production's sudo rule for /usr/sbin/pct and
  nothing else (inventory/production.example/sudoers.d/ansible_pct): pct refuses any other user, so
  every node check and every task in a container goes through sudo;
- the node's driver lists, in a container, only the container's own processes with its own pids
  (compute_apps="container", newer drivers): the GPU waits judge by memory and what they are shown;
- CT 201 is given GPUs 0 and 1 of the node, which CT 200's run uses.

The tests share the sim and run in order (deploy, a refused deploy, restart, status, stop).
"""

import re

import pytest

from pvesim import node
from pvesim.fleet import Fleet

# Under make test-reliability only (2 min, a sim of its own): make test keeps deploy, restart, status and
# stop as a node user through sudo with the narrow rule (test_narrow_sudo.py) and with production's rule
# from the example inventory (test_example_inventory.py).
pytestmark = [pytest.mark.sim, pytest.mark.slow, pytest.mark.reliability_full]

USER = "ansible"
LOGIN = re.compile(r"Accepted publickey for (\S+) from")
# The start, or a restart's stop, GPU idle check and start, in one call.
START_TASK = "Start the run once its GPUs are idle, and wait for its first training step."
# A restart's call runs as an async job; this task waits for it and returns its result.
RESTART_TASK = "Wait for the restart's call (its stop, the GPUs' idle wait, the start), saying what it does."


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("strict-node"), nodes=1, containers=(200, 201),
              gpu_passthrough={201: [0, 1]}, compute_apps="container", node_user=USER)
    yield f
    f.down()


def play(fleet, playbook, *args):
    """Run a playbook; returns its result and the users that logged in to the node meanwhile (none when
    Ansible reused its ssh connection of an earlier play)."""
    log = node.NodeFiles(fleet.sim.state_dir, "pve1").log
    before = log.stat().st_size
    res = fleet.play(playbook, *args)
    with open(log) as f:
        f.seek(before)
        logins = set(LOGIN.findall(f.read()))
    assert logins <= {USER}, logins
    return res, logins


def test_deploy_as_the_node_user_through_sudo(fleet):
    assert fleet.sim.ssh("pve1", "/usr/sbin/pct list", user=USER).stderr == "please run as root\n"
    res, logins = play(fleet, "deploy.yml", "-l", "ct200")
    assert res.rc == 0, res
    assert logins == {USER}
    check = res.results("Check the container on its Proxmox node.")["ct200"]
    assert check["msg"].startswith("CT 200 on node pve1: running") and check["gpu_count"] == 4, check
    # The busy wait saw the run: on this driver, with its pid in the container.
    run = fleet.run_info(200)
    busy = res.results("Wait until the run's GPUs are busy.")["ct200"]
    assert {p["pid"] for p in busy["processes"]} == {run["pid"]}, busy["processes"]
    assert {g["index"] for g in busy["gpus"] if g["memory_used_mib"] > 0} == {0, 1}


def test_a_container_given_the_same_gpus_fails_at_once_naming_them_and_the_holder(fleet):
    run = fleet.run_info(200)
    gpus = re.findall(r"\(UUID: (GPU-[0-9a-f-]+)\)", fleet.sim.ssh("pve1", "nvidia-smi -L").stdout)
    res, _ = play(fleet, "deploy.yml", "-l", "ct201")
    assert res.rc != 0
    messages = res.messages()
    assert "ct201 (CT 201 on pve1) failed at \"Check the container on its Proxmox node.\"" in messages
    for index in (0, 1):
        assert f"GPU {index} ({gpus[index]}) by CT 200 (pid " in messages, messages
    assert "Two containers are given the same GPU: stop what runs there (CT 200)" in messages
    # It failed in the node check, before the start's GPU wait (dflash_run_gpu_timeout) could begin.
    check = next(t for t in res.tasks if t.name.endswith("Check the container on its Proxmox node."))
    assert check.hosts["ct201"].get("failed") and check.seconds < 30
    assert not res.results(START_TASK)
    # CT 200's run is untouched; CT 201 got nothing.
    assert fleet.run_info(200) == run and fleet.alive(200, run["pid"])
    assert fleet.run_info(201) is None and fleet.live_release(201) == ""


def test_restart_as_the_node_user(fleet):
    old = fleet.run_info(200)
    res, _ = play(fleet, "restart_training.yml", "-l", "ct200")
    assert res.rc == 0, res
    new = fleet.run_info(200)
    assert new["pid"] != old["pid"] and fleet.alive(200, new["pid"]) and not fleet.alive(200, old["pid"])
    # Between the stop and the start the GPUs were idle (the restart's one call checked), and the new run
    # holds them (its own pid listed).
    assert res.results(RESTART_TASK)["ct200"]["gpu_idle"]["processes"] == []
    busy = res.results("Wait until the run's GPUs are busy.")["ct200"]
    assert {p["pid"] for p in busy["processes"]} == {new["pid"]}


def test_status_as_the_node_user(fleet):
    run = fleet.run_info(200)
    res, _ = play(fleet, "status.yml")
    assert res.rc == 0, res
    table = next(iter(res.results("Show the fleet's runs.").values()))["msg"]
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert rows["ct200"][3] == "running" and int(rows["ct200"][4]) == run["pid"], table
    assert rows["ct201"][2:4] == ["-", "stopped"], table


def test_stop_as_the_node_user_and_the_idle_wait_sees_what_still_holds_a_gpu(fleet):
    run = fleet.run_info(200)
    # A process of CT 200 outside the run holds GPU 1: the idle wait after the stop must see it.
    holder = int(fleet.ct(200, "CUDA_VISIBLE_DEVICES=1 exec sleep 300 >/dev/null 2>&1 & echo $!").stdout)
    try:
        res, _ = play(fleet, "stop_training.yml", "-l", "ct200", "-e", "dflash_run_gpu_timeout=4")
    finally:
        fleet.ct(200, f"kill {holder}")
    assert res.results("Stop the run (the trainer checkpoints on SIGTERM).")["ct200"]["how"] == "terminated"
    assert not fleet.alive(200, run["pid"]) and fleet.status(200)["state"] == "stopped"
    assert res.rc != 0
    idle = res.results("Wait until the run's GPUs are idle.")["ct200"]
    assert idle.get("failed") and [p["pid"] for p in idle["processes"]] == [holder], idle
    assert str(holder) in res.messages()
