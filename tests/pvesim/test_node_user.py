"""A sim whose nodes Ansible reaches as a user other than root (`pvesim.up(node_user=...)`): a machine
user with production's sudo rule for /usr/sbin/pct (inventory/production.example/sudoers.d/ansible_pct)
and the sim's additions, all of it gone after `down`."""

import base64
import json
import pwd
import re

import pytest
from simtools import in_ct

import pvesim
from pvesim import host

pytestmark = pytest.mark.sim

USER = "ansible"
APPS = "nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits"


def named_by_a_sim(user):
    entries = host.REGISTRY.glob("[0-9a-f]*")
    return any(json.loads(entry.read_text()).get("node_user") == user for entry in entries)


def test_the_node_user_runs_pct_through_sudo_and_nothing_else_as_root(sim_factory):
    s = sim_factory(nodes=1, containers=(370,), gpus=2, node_user=USER)
    hosts = s.inventory_path.read_text()
    assert hosts.count(f"ansible_user: {USER}") == 2 and "ansible_user: root" not in hosts

    def on_node(command):
        return s.ssh("pve1", command, user=USER)

    assert on_node("id -un").stdout == f"{USER}\n"
    # pct refuses the user; through sudo it serves this node's containers.
    assert (on_node("/usr/sbin/pct list").returncode, on_node("/usr/sbin/pct list").stderr) == \
        (255, "please run as root\n")
    assert "370        running" in on_node("sudo -n /usr/sbin/pct list").stdout
    # The rule grants pct and nothing else.
    refused = on_node("sudo -n id")
    assert refused.returncode == 1 and "a password is required" in refused.stderr
    # pct exec keeps sudo's environment (env_reset: root's HOME and USER, SUDO_*), PATH forced by pct.
    lines = on_node("sudo -n /usr/sbin/pct exec 370 -- env").stdout.splitlines()
    env = dict(line.split("=", 1) for line in lines if "=" in line)
    assert (env["USER"], env["HOME"], env["SUDO_USER"], env["PATH"]) == \
        ("root", "/root", USER, "/sbin:/bin:/usr/sbin:/usr/bin")
    # The node's nvidia-smi shows the user every process on the node's GPUs, as the driver does.
    holder = "CUDA_VISIBLE_DEVICES=1 exec sleep 60 >/dev/null 2>&1 & echo $!"
    started = s.ssh("pve1", in_ct(370, "/bin/sh", "-c", holder))
    try:
        listed = [line.split(", ") for line in on_node(APPS).stdout.splitlines()]
        as_root = [line.split(", ") for line in s.ssh("pve1", APPS).stdout.splitlines()]
        assert len(listed) == 1 and listed == as_root
        assert "/lxc/370/" in open(f"/proc/{listed[0][0]}/cgroup").read()
    finally:
        s.ssh("pve1", in_ct(370, "kill", started.stdout.strip()))
    rules = (host.SUDOERS_DIR / f"pvesim-{s.tag}").read_text()
    assert re.search(rf"^{USER} ALL = \(root\) NOPASSWD: /usr/sbin/pct$", rules, re.M)
    assert "env_keep" not in rules and "SETENV" not in rules
    authorized = pwd.getpwnam(USER).pw_dir + "/.ssh/authorized_keys"
    # `up` again with the same layout keeps the sim (and its user); the user is part of the layout.
    same = dict(nodes=1, containers=(370,), gpus=2, state_dir=s.state_dir, inventory=s.inventory_path)
    assert pvesim.up(**same, node_user=USER).nodes == s.nodes
    with pytest.raises(pvesim.SimError, match="another layout"):
        pvesim.up(**same)

    pvesim.down(s.state_dir)
    assert not (host.SUDOERS_DIR / f"pvesim-{s.tag}").exists()
    if not named_by_a_sim(USER):
        with pytest.raises(KeyError):
            pwd.getpwnam(USER)
    else:
        assert str(s.state_dir) not in open(authorized).read()


# A state dir of the node user's own, whose pct (found through provision.json) leaves a file saying who
# ran it: as root, it would be the user's code run as root.
EVIL_PCT = """#!/usr/bin/python3
import os, sys
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "ran-as-%d" % os.geteuid()), "w").close()
sys.exit(0)
"""


def test_the_node_user_cannot_have_sudo_pct_run_code_of_its_own(sudo_sim):
    def on_node(command):
        return sudo_sim.ssh("pve1", command, user=USER)

    evil = pwd.getpwnam(USER).pw_dir + "/evil"
    script = f"{evil}/pkg/pvesim/bin/pct"
    stand_in = base64.b64encode(EVIL_PCT.encode()).decode()
    made = on_node(f"rm -rf {evil} && mkdir -p {evil}/nodes/pve1 {evil}/pkg/pvesim/bin && "
                   f"printf '%s' '{{\"path\": \"{evil}/pkg\"}}' > {evil}/nodes/pve1/provision.json && "
                   f"echo {stand_in} | base64 -d > {script} && chmod 755 {script} && {script}")
    assert made.returncode == 0, made.stderr
    ran_as_user = ["pct", f"ran-as-{pwd.getpwnam(USER).pw_uid}"]  # the stand-in works, run as the user
    assert on_node(f"ls {evil}/pkg/pvesim/bin").stdout.split() == ran_as_user
    # Through sudo the node is the session's own, whatever the caller passes: pvesim's pct serves CT 390.
    forged = on_node(f"PVESIM_STATE_DIR={evil} PVESIM_NODE=pve1 sudo -n /usr/sbin/pct list")
    assert forged.returncode == 0 and "390        running" in forged.stdout, forged
    # This sim's rules keep no environment for pct, so sudo sets none the caller names (another sim's rules
    # on the machine may: then the session's node serves it all the same).
    named = on_node(f"sudo -n PVESIM_STATE_DIR={evil} PVESIM_NODE=pve1 /usr/sbin/pct list")
    assert (named.returncode == 1 and "not allowed to set" in named.stderr) or \
        (named.returncode == 0 and "390        running" in named.stdout), named
    # sudo's own command line is the caller's words, not the node's sshd: a registered sim's other node
    # named in it is not taken for the session's.
    fake_sshd = f"-f {sudo_sim.state_dir}/nodes/pve9/sshd_config"
    node_seen = on_node(f"sudo -n /usr/sbin/pct exec 390 -- sh -c 'echo $PVESIM_NODE' {fake_sshd}")
    assert node_seen.stdout == "pve1\n", node_seen
    assert on_node(f"ls {evil}/pkg/pvesim/bin").stdout.split() == ran_as_user  # never as root
    on_node(f"rm -rf {evil}")


def test_root_is_no_node_user(tmp_path):
    with pytest.raises(pvesim.SimError, match="node_user must be a user name other than root"):
        pvesim.up(nodes=1, containers=(371,), gpus=0, state_dir=tmp_path / "state",
                  inventory=tmp_path / "hosts.yml", node_user="root")
