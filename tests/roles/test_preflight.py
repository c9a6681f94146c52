"""The playbooks refuse a bad inventory before touching anything (no sim needed)."""

import subprocess

import pytest

from pvesim.fleet import REPO, VENV_BIN, ansible_env

PLAYBOOKS = ["deploy.yml", "restart_training.yml", "stop_training.yml", "status.yml", "rollback.yml"]


def run_playbook(playbook, inventory, *args):
    argv = [str(VENV_BIN / "ansible-playbook"), "-i", str(inventory), *args,
            str(REPO / "playbooks" / playbook)]
    return subprocess.run(argv, env=ansible_env(), capture_output=True, text=True, cwd=REPO, timeout=120,
                          stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("playbook", PLAYBOOKS)
def test_playbooks_fail_clearly_without_training_containers(tmp_path, playbook):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("all:\n  children:\n    proxmox_hosts:\n      hosts:\n        pve1: {}\n")
    res = run_playbook(playbook, inventory)
    assert res.returncode != 0
    assert "has no hosts in group training_containers" in res.stdout


def test_a_container_without_vmid_or_node_is_refused_before_anything_runs(tmp_path):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        "all:\n  children:\n"
        "    proxmox_hosts:\n      hosts:\n        pve1: {ansible_host: 192.0.2.1}\n"
        "    training_containers:\n      hosts:\n"
        "        ct200: {ansible_connection: community.proxmox.proxmox_pct_remote, ansible_host: 192.0.2.1,\n"
        "                proxmox_vmid: 200, proxmox_node: pve1}\n"
        "        ct201: {ansible_connection: community.proxmox.proxmox_pct_remote,\n"
        "                ansible_host: 192.0.2.1}\n")
    res = run_playbook("deploy.yml", inventory)
    assert res.returncode != 0
    assert "ct201: a training container needs proxmox_vmid" in res.stdout
    # any_errors_fatal: ct200 is not touched either (it would be unreachable at 192.0.2.1).
    assert "UNREACHABLE" not in res.stdout


def test_a_run_across_containers_is_checked_on_every_member_before_anything_runs(tmp_path):
    inventory = tmp_path / "hosts.yml"
    container = ("{ansible_connection: community.proxmox.proxmox_pct_remote, ansible_host: 192.0.2.1, "
                 "proxmox_vmid: %d, proxmox_node: pve1, dflash_run_members: %s, dflash_run_address: '%s'}")
    members = "[{host: ct200, drafters: 1, targets: 1}, {host: ct201, drafters: 1, targets: 1}]"
    reordered = "[{host: ct201, drafters: 1, targets: 1}, {host: ct200, drafters: 1, targets: 1}]"
    inventory.write_text(
        "all:\n  children:\n"
        "    proxmox_hosts:\n      hosts:\n        pve1: {ansible_host: 192.0.2.1}\n"
        "    training_containers:\n      hosts:\n"
        f"        ct200: {container % (200, members, '192.0.2.20')}\n"
        f"        ct201: {container % (201, reordered, '')}\n")
    res = run_playbook("stop_training.yml", inventory)
    assert res.returncode != 0
    assert ("ct200: the members of a run must declare the same dflash_run_members (in the same order) "
            "on every member. every member needs dflash_run_address") in res.stdout, res.stdout
    assert "UNREACHABLE" not in res.stdout
    # A limit that leaves a member out is refused: the run is stopped and shown as one.
    inventory.write_text(inventory.read_text().replace(reordered, members).replace("''", "'192.0.2.21'"))
    limited = run_playbook("status.yml", inventory, "-l", "ct200")
    assert limited.returncode != 0
    assert "the play (-l) must include all its members (ct200, ct201), it leaves out ct201." in limited.stdout

