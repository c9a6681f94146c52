"""Ansible reaches the sim's nodes over ssh, its containers through pct_pipelined
(community.proxmox.proxmox_pct_remote with pipelining)."""

import json
import subprocess
import sysconfig
import uuid
from pathlib import Path

import pytest

from pvesim.fleet import VENV_BIN, ansible_env

pytestmark = pytest.mark.sim

REPO_CFG = Path(__file__).resolve().parents[2] / "ansible.cfg"


@pytest.mark.slow
def test_ping_reaches_every_node_and_container(sim, run_ansible):
    res = run_ansible("ansible", "all", "-m", "ansible.builtin.ping", check=True)
    for host in ["pve1", "pve2", "ct200", "ct201", "ct202", "ct203"]:
        assert f"{host} | SUCCESS" in res.stdout


def test_inventory_puts_containers_behind_the_pct_connection(sim, run_ansible):
    res = run_ansible("ansible-inventory", "--list", check=True)
    inv = json.loads(res.stdout)
    assert sorted(inv["proxmox_hosts"]["hosts"]) == ["pve1", "pve2"]
    assert sorted(inv["training_containers"]["hosts"]) == ["ct200", "ct201", "ct202", "ct203"]
    ct202 = inv["_meta"]["hostvars"]["ct202"]
    pve2 = sim.node("pve2")
    assert ct202["ansible_connection"] == "dflash.ops.pct_pipelined"
    assert (ct202["ansible_host"], ct202["ansible_port"]) == (pve2.address, pve2.port)
    assert ct202["proxmox_vmid"] == 202
    assert ct202["pvesim_node"] == "pve2"
    # The venv's site-packages, which the sim's trainer venvs borrow (seen in the containers too).
    assert ct202["pvesim_site_packages"] == sysconfig.get_paths()["purelib"]
    assert (Path(ct202["pvesim_site_packages"]) / "yaml").is_dir()
    assert "StrictHostKeyChecking=yes" in inv["_meta"]["hostvars"]["pve1"]["ansible_ssh_common_args"]


@pytest.mark.slow
def test_copy_lands_in_the_container_only(sim, run_ansible, tmp_path):
    name = f"copied-{uuid.uuid4().hex[:8]}"
    src = tmp_path / "payload.txt"
    src.write_text("payload for ct201\n")
    run_ansible("ansible", "ct201", "-m", "ansible.builtin.copy",
                "-a", f"src={src} dest=/root/{name} mode=0640", check=True)
    inside = sim.ssh("pve1", f"pct exec 201 -- stat -c '%a %U' /root/{name}; "
                             f"pct exec 201 -- cat /root/{name}")
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout == "640 root\npayload for ct201\n"
    on_node = sim.ssh("pve1", f"test -e /root/{name}")
    assert on_node.returncode == 1
    other_ct = sim.ssh("pve1", f"pct exec 200 -- test -e /root/{name}")
    assert other_ct.returncode == 1


def _pct_execs(res):
    return [line for line in (res.stdout + res.stderr).splitlines() if "EXEC /usr/sbin/pct exec" in line]


def test_pct_pipelined_runs_a_module_in_one_pct_exec(sim, run_ansible):
    """The project's connection pipelines: the module reaches the container's python on stdin in one
    `pct exec`; switched off (or with the collection's own connection) it takes five or more."""
    piped = run_ansible("ansible", "ct201", "-m", "ansible.builtin.command", "-a", "cat /etc/hostname",
                        "-vvv", check=True)
    assert "ct201 | CHANGED" in piped.stdout
    assert len(_pct_execs(piped)) == 1, _pct_execs(piped)
    assert "/usr/bin/python3 && sleep 0'" in _pct_execs(piped)[0]
    for extra in ("ansible_pct_pipelining=false", "ansible_pipelining=false",
                  "ansible_connection=community.proxmox.proxmox_pct_remote"):
        plain = run_ansible("ansible", "ct201", "-m", "ansible.builtin.command", "-a", "cat /etc/hostname",
                            "-vvv", "-e", extra, check=True)
        assert len(_pct_execs(plain)) >= 5, (extra, _pct_execs(plain))
        # Same container, same answer, either way.
        assert plain.stdout.split("\n", 1)[0].split("|")[0] == piped.stdout.split("\n", 1)[0].split("|")[0]


def test_ansibles_own_pipelining_and_pty_settings_apply(sim, tmp_path):
    """ANSIBLE_PIPELINING=False and [defaults] pipelining = False turn pipelining off, as for ansible-core's
    connections; with a PTY asked for (ANSIBLE_PARAMIKO_PTY, [paramiko_connection] pty) a pipelined module
    still gets none, so it neither hangs nor sees its input echoed."""
    config = tmp_path / "ansible.cfg"
    text = REPO_CFG.read_text().replace("collections_path = .", f"collections_path = {REPO_CFG.parent}")
    config.write_text(text.replace("[defaults]\n", "[defaults]\npipelining = False\n", 1))

    def pct_execs(**env):
        res = subprocess.run([str(VENV_BIN / "ansible"), "-i", str(sim.inventory_path), "ct201", "-vvv",
                              "-m", "ansible.builtin.command", "-a", "cat /etc/hostname"],
                             env=ansible_env(**env), capture_output=True, text=True, timeout=120,
                             stdin=subprocess.DEVNULL, cwd=REPO_CFG.parent)
        assert "ct201 | CHANGED" in res.stdout, res.stdout + res.stderr
        return len(_pct_execs(res))

    assert pct_execs() == 1
    assert pct_execs(ANSIBLE_PIPELINING="False") >= 5
    assert pct_execs(ANSIBLE_CONFIG=str(config)) >= 5
    assert pct_execs(ANSIBLE_PARAMIKO_PTY="True") == 1
