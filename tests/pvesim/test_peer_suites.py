"""The connection test suites of ansible-core and community.proxmox, run as their projects release them,
against a pvesim container through dflash.ops.pct_pipelined, with and without pipelining.

Where they come from (`make peer-suites`, scripts/peer_suites.py, at the versions the venv runs):
- ansible-core 2.19.x's `test/integration/targets/connection` (test_connection.yml: raw with unicode,
  copy and fetch of `汉语-['foo bar'].txt` with a checksum, wait_for_connection; no connection vars in
  the output; both reset_connection playbooks), from its sdist;
- community.proxmox 1.4.0's `connection_proxmox_pct_remote` (its copy of the connection target through
  `connection_posix/test.sh`, then plugin-specific-tests.yml), from the sdist of the `ansible` package.

What is ours is the inventory alone: the suite's own group of two hosts (pipelining on and off) pointing at
a sim container. community.proxmox's runme.sh first runs dependencies.yml, which installs a mock pct over
/usr/sbin/pct on the controller (and paramiko); pvesim's real pct and the venv's paramiko take its place,
so that step is left out, and the directory its mock pct creates for each container
(`/tmp/ansible-remote/...`) is made in the container, as the mock would have.
"""

import re
import shutil
import subprocess

import pytest

from pvesim.fleet import ansible_env
from scripts.peer_suites import DEFAULT_DIR, suite_dir

pytestmark = pytest.mark.sim

ANSIBLE_CORE_TARGET = "test/integration/targets/connection"
PROXMOX_TARGETS = "ansible_collections/community/proxmox/tests/integration/targets"
# The arguments connection_posix/test.sh (community.proxmox's runner of a connection target) passes.
SUITE_ARGS = ["-e", "action_prefix=", "-e", "local_tmp=/tmp/ansible-local",
              "-e", "remote_tmp=/tmp/ansible-remote"]


def peer_suite(dist, path):
    found = suite_dir(DEFAULT_DIR, dist) / path
    if not (suite_dir(DEFAULT_DIR, dist) / ".complete").exists():
        pytest.fail(f"the peer suites are not unpacked ({found}): run `make peer-suites`", pytrace=False)
    return found


def inventory(group, sim, vmid):
    """The suite's inventory, adapted: its group, its two hosts, and the container's connection."""
    hv = {key: value for key, value in sim_hostvars(sim, vmid).items() if not key.startswith("pvesim_")}
    lines = [f"[{group}]", f"{group}-pipelining ansible_pipelining=true",
             f"{group}-no-pipelining ansible_pipelining=false", f"[{group}:vars]"]
    return "\n".join(lines + [f"{key}={value}" for key, value in hv.items()]) + "\n"


def sim_hostvars(sim, vmid):
    from pvesim.sim import container_hostvars
    return container_hostvars(sim, sim.node_of(vmid).name, vmid)


def run(argv, cwd, **env):
    res = subprocess.run(argv, cwd=cwd, env=ansible_env(**env), capture_output=True, text=True, timeout=600,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, \
        f"{' '.join(argv)} in {cwd} exited {res.returncode}\n{res.stdout[-6000:]}\n{res.stderr[-3000:]}"
    return res.stdout


def assert_hosts_ran(group, out, tasks):
    """Both hosts of the suite's group ran its tasks (the recaps' ok counts add up), none failed."""
    for host in (f"{group}-pipelining", f"{group}-no-pipelining"):
        recaps = re.findall(rf"^{host}\s*: ok=(\d+) .*failed=(\d+)", out, re.M)
        assert recaps and sum(int(ok) for ok, _ in recaps) >= tasks and not any(int(f) for _, f in recaps), \
            (host, recaps, out[-3000:])


def ansible_core_suite(sim, vmid, tmp_path):
    target = tmp_path / "connection"
    shutil.copytree(peer_suite("ansible-core", ANSIBLE_CORE_TARGET), target)
    (tmp_path / "test_connection.inventory").write_text(inventory("pct_pipelined", sim, vmid))
    out = run(["bash", "./test.sh", "-e", "target_hosts=pct_pipelined", *SUITE_ARGS], target,
              INVENTORY=str(tmp_path / "test_connection.inventory"))
    assert "SUCCESS: Connection vars not found" in out
    assert_hosts_ran("pct_pipelined", out, tasks=11)


def community_proxmox_suite(sim, vmid, tmp_path):
    targets = tmp_path / "targets"
    shutil.copytree(peer_suite("ansible", PROXMOX_TARGETS), targets)
    here = targets / "connection_proxmox_pct_remote"
    (here / "test_connection.inventory").write_text(inventory("proxmox_pct_remote", sim, vmid))
    node = sim.node_of(vmid).name
    mock_dir = f"/tmp/ansible-remote/proxmox_pct_remote/integration_test/ct_{vmid}"
    made = sim.ssh(node, f"pct exec {vmid} -- mkdir -p {mock_dir}")
    assert made.returncode == 0, made.stderr
    # runme.sh, less its dependencies.yml (see the module docstring)
    out = run(["bash", "./test.sh"], here)
    out += run(["ansible-playbook", "plugin-specific-tests.yml", "-i", "./test_connection.inventory",
                "-e", "target_hosts=proxmox_pct_remote", *SUITE_ARGS], here)
    assert_hosts_ran("proxmox_pct_remote", out, tasks=11 + 4)


SUITES = {"ansible-core": ansible_core_suite, "community.proxmox": community_proxmox_suite}


@pytest.mark.reliability
@pytest.mark.parametrize("suite", SUITES)
def test_the_peer_suites_pass_as_root(suite, sim, tmp_path):
    SUITES[suite](sim, 201, tmp_path)


@pytest.mark.reliability_full
@pytest.mark.parametrize("suite", SUITES)
def test_the_peer_suites_pass_through_sudo(suite, sudo_sim, tmp_path):
    SUITES[suite](sudo_sim, 390, tmp_path)
