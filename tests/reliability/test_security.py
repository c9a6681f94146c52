"""Security basics: host key checking stays on everywhere and an unknown key is refused by a real
connection; the sudo rule for a non-root node user grants /usr/sbin/pct and nothing else."""

import configparser
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

from pvesim import host
from pvesim.fleet import VENV_BIN, ansible_env, run_module
from pvesim.sim import Sim, SimNode, inventory_data
from tests.reliability.input_support import REPO

SUDOERS = REPO / "inventory" / "production.example" / "sudoers.d" / "ansible_pct"
# Where host key checking could be turned off: Ansible's config, the inventories, the playbooks and
# roles, the simulation, the scripts and the CI entry points.
SCANNED = ["ansible.cfg", "Makefile", ".ci", "inventory", "playbooks", "ansible_collections", "pvesim",
           "scripts", "tests/molecule"]
CHECKING_OFF = re.compile(
    r"StrictHostKeyChecking\s*[= ]\s*(no|off|accept-new)\b|UserKnownHostsFile\s*[= ]\s*/dev/null"
    r"|host_key_checking\s*[:=]\s*[\"']?(false|no|off|0)\b|HOST_KEY_CHECKING\s*[:=]\s*[\"']?(false|no|off|0)\b"
    r"|host_key_auto_add\s*[:=]\s*[\"']?(true|yes|on|1)\b", re.IGNORECASE)


def scanned_files():
    for name in SCANNED:
        path = REPO / name
        for f in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
            if "__pycache__" not in f.parts and f.suffix not in (".pyc", ".png"):
                yield f


def test_host_key_checking_is_on_in_the_config_and_never_turned_off():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "ansible.cfg")
    assert cfg.getboolean("defaults", "host_key_checking") is True
    offending = [f"{f.relative_to(REPO)}: {m.group(0)}" for f in scanned_files()
                 for m in CHECKING_OFF.finditer(f.read_text(errors="replace"))]
    assert offending == []
    assert len(list(scanned_files())) > 50  # the scan saw the tree, not an empty list


def test_the_sim_inventory_checks_host_keys_against_its_own_known_hosts(tmp_path):
    sim = Sim(state_dir=tmp_path, nodes=[SimNode("pve1", "127.0.0.2", 2222, [200])], gpus=1,
              inventory_path=tmp_path / "hosts.yml")
    data = inventory_data(sim)["all"]["children"]
    node = data["proxmox_hosts"]["hosts"]["pve1"]
    assert f"UserKnownHostsFile={tmp_path / 'known_hosts'}" in node["ansible_ssh_common_args"]
    assert "StrictHostKeyChecking=yes" in node["ansible_ssh_common_args"]
    container = data["training_containers"]["hosts"]["ct200"]
    assert not [k for k in container if "host_key" in k]  # the container's connection keeps its default: on


def production_example_vars():
    argv = [str(VENV_BIN / "ansible-inventory"), "-i", str(REPO / "inventory" / "production.example"),
            "--list", "--export"]
    res = subprocess.run(argv, env=ansible_env(), capture_output=True, text=True, cwd=REPO, timeout=120)
    assert res.returncode == 0, res.stderr
    return yaml.safe_load(res.stdout)


def test_the_production_example_keeps_host_key_checking_on():
    inventory = production_example_vars()
    text = yaml.safe_dump(inventory)
    assert "pve1" in text and "ct200" in text
    assert not CHECKING_OFF.search(text)
    assert "host_key_checking" not in text


@pytest.mark.sim
def test_an_unknown_host_key_is_refused_by_the_node_and_the_container_connections(sim_factory, tmp_path):
    sim = sim_factory(nodes=1, containers=(350,), gpus=1)
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    inventory = yaml.safe_load(sim.inventory_path.read_text())
    node = inventory["all"]["children"]["proxmox_hosts"]["hosts"]["pve1"]
    node["ansible_ssh_common_args"] = node["ansible_ssh_common_args"].replace(str(sim.known_hosts),
                                                                              str(empty))
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump(inventory))

    def ping(pattern):
        return subprocess.run([str(VENV_BIN / "ansible"), "-i", str(tmp_path / "hosts.yml"), pattern, "-m",
                               "ansible.builtin.ping"], env=ansible_env(), capture_output=True, text=True,
                              cwd=REPO, timeout=120, stdin=subprocess.DEVNULL)

    # pvesim also puts its keys in the system known_hosts (ssh's global file, and the one the containers'
    # paramiko connection reads): without them, and with an empty user file, no key of the node is known.
    host.remove_system_known_hosts(sim.state_dir)
    try:
        node_ping, container_ping = ping("pve1"), ping("ct350")
        # Through ansible-runner (a terminal, where ssh and paramiko ask about the key): refused too,
        # at once rather than at the run's timeout.
        on_a_terminal = {pattern: run_module("ansible.builtin.ping", None, tmp_path / "hosts.yml", pattern,
                                             timeout=90) for pattern in ("pve1", "ct350")}
    finally:
        sim.trust_host_keys()
    assert node_ping.returncode != 0 and "UNREACHABLE" in node_ping.stdout
    assert "Host key verification failed" in node_ping.stdout, node_ping.stdout
    # The containers' connection (paramiko) asks to confirm an unknown key on a terminal; without one
    # pct_pipelined says which key is missing and how to check it. Either way nothing connects or is recorded.
    assert container_ping.returncode != 0 and "UNREACHABLE" in container_ping.stdout
    port = sim.node("pve1").port
    assert (f"the ssh host key of 127.0.0.2 port {port} (the container's Proxmox node) is not known"
            in container_ping.stdout), container_ping.stdout
    assert f"ssh-keyscan -p {port} 127.0.0.2" in container_ping.stdout
    for pattern, res in on_a_terminal.items():
        assert res.status == "failed" and res.stats[pattern]["unreachable"] == 1, res
    user_known_hosts = Path.home() / ".ssh" / "known_hosts"
    assert not user_known_hosts.exists() or f"[127.0.0.2]:{port}" not in user_known_hosts.read_text()
    # The same pings pass once the keys are known again: the refusals above were the host keys' doing.
    assert ping("pve1").returncode == 0 and ping("ct350").returncode == 0


def sudo_rules(path=SUDOERS):
    lines = [line.strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_the_provision_rule_grants_pct_and_the_storage_tools_by_their_absolute_paths():
    rules = sudo_rules(SUDOERS.with_name("ansible_provision"))
    assert rules == ["ansible ALL = (root) NOPASSWD: "
                     "/usr/sbin/pct, /usr/sbin/pvesm, /usr/bin/pveam, /usr/bin/pvesh"]
    for doc in ("README.md", "sudoers.d/ansible_pct"):
        assert "sudoers.d/ansible_provision" in (SUDOERS.parents[1] / doc).read_text()


def test_the_sudo_rule_grants_pct_and_nothing_else():
    rules = sudo_rules()
    assert len(rules) == 1
    match = re.fullmatch(r"(?P<user>[a-z_][a-z0-9_-]*)\s+(?P<hosts>\S+)\s*=\s*\((?P<runas>[^)]*)\)\s*"
                         r"(?P<tags>(?:[A-Z_]+:\s*)*)(?P<commands>.+)", rules[0])
    assert match, rules[0]
    assert match["runas"] == "root"
    assert match["tags"].split() == ["NOPASSWD:"]
    assert [c.strip() for c in match["commands"].split(",")] == ["/usr/sbin/pct"]
    # The inventory's README and hosts.yml show the same rule and point at the file.
    for doc in ("README.md", "hosts.yml"):
        assert "sudoers.d/ansible_pct" in (SUDOERS.parents[1] / doc).read_text()
    assert rules[0] in (SUDOERS.parents[1] / "README.md").read_text()


PROXMOX_HOST = REPO / "ansible_collections" / "dflash" / "ops" / "roles" / "proxmox_host"


def render(expression, variables):
    trusted = {name: trust_as_template(value) if isinstance(value, str) else value
               for name, value in variables.items()}
    templar = Templar(loader=DataLoader(), variables=trusted)
    return templar.template(trust_as_template(expression))


def test_the_node_checks_run_nothing_but_pct_as_root():
    """The node checks (the proxmox_host role, which the playbooks run) run no command of their own:
    pct_container_check runs pct through its argv prefix alone (sudo -n /usr/sbin/pct when the node's user
    is not root; tests/modules/test_pct_container_check.py), so the sudo rule above is all a non-root node
    user needs."""
    checks = []
    for path in sorted((PROXMOX_HOST / "tasks").glob("*.yml")):
        for task in yaml.safe_load(path.read_text()) or []:
            ran = [m for m in ("ansible.builtin.command", "ansible.builtin.shell", "ansible.builtin.raw",
                               "command", "shell", "raw") if m in task]
            assert not ran, f"{path.name}: {task['name']} runs {ran}"
            if "dflash.ops.pct_container_check" in task:
                checks.append(task["dflash.ops.pct_container_check"]["pct_argv"])
                assert task["delegate_to"] == "{{ proxmox_host_node }}"
    assert checks == ["{{ __proxmox_host_pct_argv }}"]
    role_vars = yaml.safe_load((PROXMOX_HOST / "vars" / "main.yml").read_text())
    defaults = yaml.safe_load((PROXMOX_HOST / "defaults" / "main.yml").read_text())
    cases = (({}, {}), ({"ansible_user": "root"}, {}), ({"ansible_user": "ansible"}, {}),
             ({"ansible_user": "ansible"}, {"proxmox_host_pct_sudo": False}),
             ({}, {"proxmox_host_pct_sudo": True, "proxmox_host_pct_path": "/opt/pve/pct"}))
    for node_vars, role_inventory in cases:
        variables = {**defaults, "proxmox_vmid": 200, "proxmox_node": "pve1",
                     "hostvars": {"pve1": node_vars}, **role_inventory}
        role_argv = render(role_vars["__proxmox_host_pct_argv"], variables)
        sudo = role_inventory.get("proxmox_host_pct_sudo", node_vars.get("ansible_user", "root") != "root")
        path = role_inventory.get("proxmox_host_pct_path", "/usr/sbin/pct")
        assert role_argv == ["sudo", "-n"] * sudo + [path], (node_vars, role_inventory)
    assert role_vars["__proxmox_host_pct_argv"] == (
        "{{ (['sudo', '-n'] if proxmox_host_pct_sudo | bool else []) + [proxmox_host_pct_path] }}")


@pytest.mark.skipif(not shutil.which("visudo"), reason="visudo is not installed (apt-get install sudo)")
def test_visudo_accepts_the_sudo_rule(tmp_path):
    copy = tmp_path / "ansible_pct"
    copy.write_text(SUDOERS.read_text())
    copy.chmod(0o440)
    res = subprocess.run(["visudo", "-cf", str(copy)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_sudo_rule_names_the_path_the_roles_use():
    defaults = yaml.safe_load((PROXMOX_HOST / "defaults" / "main.yml").read_text())
    assert defaults["proxmox_host_pct_path"] == "/usr/sbin/pct"
    assert Path(sudo_rules()[0].rsplit(None, 1)[1]) == Path(defaults["proxmox_host_pct_path"])
