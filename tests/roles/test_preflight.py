"""The playbooks refuse a bad inventory before touching anything (no sim needed)."""

import subprocess

import pytest

from pvesim.fleet import REPO, VENV_BIN, ansible_env

PLAYBOOKS = ["deploy.yml", "restart_training.yml", "stop_training.yml", "status.yml", "rollback.yml"]


def run_playbook(playbook, inventory):
    argv = [str(VENV_BIN / "ansible-playbook"), "-i", str(inventory), str(REPO / "playbooks" / playbook)]
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
