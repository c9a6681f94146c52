"""Provisioning under bad input, a reconcile, a destroy and a kill: `provision.yml` never leaves a
half-made container, never touches a container whose run is live, and a killed run converges when run
again.

The fleet: pve1 with CT 200 (GPUs 0 and 1), pve2 with CT 202 (GPUs 0 and 1) and VM 300. The inventory
adds containers of pve1 that do not exist yet: ct201 (GPUs 2 and 3), ct205 (GPU 3, the bad-input cases'
target) and ct206 (GPU 3 too, the killed runs' target); the last two may share it. The "Bad input to
provisioning" table of docs/RELIABILITY.md lists the same cases.
"""

import json
import random
import time
from dataclasses import dataclass

import pytest

from pvesim.fleet import VENV_BIN
from tests.reliability.deploy_faults_support import REPO, kill_deploy_when
from tests.reliability.input_support import InputFleet, doc_table, shown
from tests.reliability.trial_counts import trials

pytestmark = [pytest.mark.sim, pytest.mark.slow]

SMALL = dict(proxmox_provision_cores=2, proxmox_provision_memory=4096, proxmox_provision_rootfs_size=8)
TARGET = 205
KILLED = 206


@dataclass(frozen=True)
class Case:
    case: str  # the "provisioning case" column of docs/RELIABILITY.md's table
    variables: dict
    words: tuple  # what the message must say (cause and fix); the table's row says it too
    setup: str = ""  # a shell command on pve1 first (undone by `undo`)
    undo: str = ""
    fast: bool = False

    @property
    def id(self):
        return "-".join(self.case.lower().replace("`", "").split()[:6])


CASES = [
    Case("A template missing on the node's storage",
         {"proxmox_provision_template": "local:vztmpl/debian-13-standard_13.1-1_amd64.tar.zst"},
         ("the template local:vztmpl/debian-13-standard_13.1-1_amd64.tar.zst is not on node pve1",
          "pveam download local debian-13-standard_13.1-1_amd64.tar.zst")),
    Case("A GPU the node does not have", {"proxmox_provision_gpus": [3, 9]},
         ("node pve1 has no GPU 9 (/dev/nvidia9)", "Fix proxmox_provision_gpus")),
    Case("A GPU passed through to another container",
         {"proxmox_provision_gpus": [1], "proxmox_provision_allow_shared_gpus": False},
         ("already passed through to another container: /dev/nvidia1 by CT 200",
          "proxmox_provision_allow_shared_gpus: true")),
    Case("A vmid of a container on another node", {"proxmox_provision_vmid": 202},
         ("vmid 202 of ct205 is taken: CT 202 (ct202) exists on node pve2", "choose a free proxmox_vmid")),
    Case("A vmid of a VM", {"proxmox_provision_vmid": 300},
         ("vmid 300 of ct205 is taken: VM 300 (vm300) exists on node pve2", "choose a free proxmox_vmid")),
    Case("Two containers of the inventory with one vmid", {"proxmox_vmid": 205},
         ("the inventory gives ct205 and ct200 and ct202", "vmid 205",
          "Give each container its own proxmox_vmid")),
    Case("A storage without room", {"proxmox_provision_rootfs_size": 5000},
         ("storage local-lvm on node pve1 has", "its root disk needs 5000 GiB",
          "proxmox_provision_rootfs_size")),
    Case("A root disk on a storage without rootdir content", {"proxmox_provision_rootfs_storage": "local"},
         ("storage local on node pve1 holds no container root disks (pvesm status --content rootdir lists "
          "local-lvm", "does not support container directories",
          "proxmox_provision_rootfs_storage: local-lvm")),
    Case("A passthrough device the node lacks",
         {"proxmox_provision_control_devices": ["/dev/nvidiactl", "/dev/nvidia-caps/nvidia-cap1"]},
         # pve-container checks every devN at create (LXC/Tools.pm get_device_mode_and_rdev), so nothing
         # is made.
         ("pct create 205 failed on node pve1 (exit 2): Device /dev/nvidia-caps/nvidia-cap1 does not exist",
          "(proxmox_provision_control_devices, proxmox_provision_gpus)"),
         fast=True),
    Case("The driver's installer missing on the node's storage", {},
         ("needs the NVIDIA user-space tools of node pve1's driver (550.127.05)",
          "NVIDIA-Linux-x86_64-550.127.05.run")),
]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = InputFleet(tmp_path_factory.mktemp("provision-faults"), nodes=2, containers=(200, 202), gpus=4,
                   gpu_passthrough={200: [0, 1], 202: [0, 1]})
    f.sim.add_vm("pve2", 300)
    f.add_to_inventory("pve1", 201, proxmox_provision_gpus=[2, 3], **SMALL)  # the sim's run uses 2 GPUs
    for vmid in (TARGET, KILLED):
        f.add_to_inventory("pve1", vmid, proxmox_provision_gpus=[3], proxmox_provision_allow_shared_gpus=True,
                           **SMALL)
    yield f
    f.down()


def node_containers(fleet):
    """{vmid: (has a Proxmox config, has an LXC side)} of pve1: a half-made container has only one."""
    root = fleet.sim.state_dir / "nodes" / "pve1"
    confs = {int(p.stem) for p in (root / "pve" / "lxc").glob("*.conf")}
    lxc = {int(p.name) for p in (root / "lxc").iterdir() if p.name.isdigit()}
    return {vmid: (vmid in confs, vmid in lxc) for vmid in confs | lxc}


def installer_moved(fleet, back=False):
    snippets = fleet.sim.state_dir / "nodes" / "pve1" / "storage" / "local" / "snippets"
    name = "NVIDIA-Linux-x86_64-550.127.05.run"
    saved = snippets / f"{name}.saved"
    (saved.rename(snippets / name) if back else (snippets / name).rename(saved))


def as_param(case):
    return pytest.param(case, id=case.id, marks=() if case.fast else pytest.mark.reliability_full)


@pytest.mark.parametrize("case", [as_param(c) for c in CASES])
def test_bad_input_fails_clearly_and_leaves_no_container(fleet, case):
    before = node_containers(fleet)
    installer = not case.variables
    if installer:
        installer_moved(fleet)
    try:
        res = fleet.play("provision.yml", "-l", f"ct{TARGET}", "-e", json.dumps(case.variables))
    finally:
        if installer:
            installer_moved(fleet, back=True)
    message = shown(res)
    assert res.rc != 0, str(res)
    for words in case.words:
        assert words in message, f"{words!r} not in what the user saw:\n{message}"
    if installer:  # the container exists (a rerun installs the tools); nothing else changed
        assert node_containers(fleet) == {**before, TARGET: (True, True)}
        fleet.sim.ssh("pve1", f"pct stop {TARGET}; pct destroy {TARGET}")
    assert node_containers(fleet) == before


def test_the_reliability_doc_table_shows_every_case_as_the_tests_see_it():
    rows = {row[0]: row for row in doc_table("## Bad input to provisioning", "provisioning case")}
    assert list(rows) == [case.case for case in CASES]
    for case in CASES:
        seen = rows[case.case][1].replace("`", "")
        for words in case.words:
            assert words in seen, f"docs/RELIABILITY.md row {case.case!r} does not say {words!r}"


@pytest.mark.reliability_full
def test_a_differing_container_is_left_alone_and_reconciled_only_without_a_live_run(fleet):
    ct = ("-l", "ct201")
    assert fleet.play("provision.yml", *ct).rc == 0
    assert fleet.play("deploy.yml", *ct).rc == 0
    pid = fleet.run_info(201)["pid"]
    before = fleet.sim.ssh("pve1", "pct config 201").stdout
    cores = ("-e", "proxmox_provision_cores=4")

    left = fleet.play("provision.yml", *ct, *cores)
    assert left.rc == 0 and left.stats["ct201"]["changed"] == 0, left
    assert "cores: 2 -> 4" in left.stdout and "left as it is" in left.stdout
    for refused_var in ("proxmox_provision_reconcile=true", "proxmox_provision_state=absent"):
        refused = fleet.play("provision.yml", *ct, *cores, "-e", refused_var)
        assert refused.rc != 0 and "has a live training run" in shown(refused), refused
        assert fleet.sim.ssh("pve1", "pct config 201").stdout == before and fleet.alive(201, pid)

    assert fleet.play("stop_training.yml", *ct).rc == 0
    reconciled = fleet.play("provision.yml", *ct, *cores, "-e", "proxmox_provision_reconcile=true", "--diff")
    assert reconciled.rc == 0 and "-cores: 2\n+cores: 4" in reconciled.stdout, reconciled
    after = fleet.sim.ssh("pve1", "pct config 201").stdout
    assert set(before.splitlines()) ^ set(after.splitlines()) == {"cores: 2", "cores: 4"}

    gone = fleet.play("provision.yml", *ct, "-e", "proxmox_provision_state=absent")
    assert gone.rc == 0, gone
    assert 201 not in node_containers(fleet)


@pytest.mark.reliability_full
def test_a_provisioning_run_killed_half_way_converges_when_run_again(fleet, tmp_path):
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    argv = [str(VENV_BIN / "ansible-playbook"), "-i", str(fleet.inventory),
            str(REPO / "playbooks" / "provision.yml"), "-l", f"ct{KILLED}"]
    started = time.monotonic()
    full = fleet.play("provision.yml", "-l", f"ct{KILLED}")
    wall = time.monotonic() - started
    assert full.rc == 0, full
    headings = []
    for trial in range(trials(2, 8)):
        fleet.sim.ssh("pve1", f"pct stop {KILLED}; pct destroy {KILLED}")
        # A kill within the run (process start to recap), never after it ended.
        delay = rng.uniform(0.5, 0.9 * wall)
        killed = kill_deploy_when(fleet, lambda elapsed, d=delay: elapsed >= d, tmp_path / f"{trial}.log",
                                  delay, argv=argv)
        headings.append(killed.heading if killed.killed else "finished")
        again = fleet.play("provision.yml", "-l", f"ct{KILLED}")
        assert again.rc == 0, f"seed {seed}, killed after {delay:.1f} s at {killed.heading}: {again}"
        assert node_containers(fleet)[KILLED] == (True, True)
        seen = fleet.ct(KILLED, "nvidia-smi --query-gpu=index --format=csv,noheader").stdout.split()
        assert seen == ["0"]
        assert fleet.play("provision.yml", "-l", f"ct{KILLED}").stats[f"ct{KILLED}"]["changed"] == 0
        assert all(both == (True, True) for both in node_containers(fleet).values())
    print(f"killed provisioning: seed {seed}, {len(headings)} trials (a full run {wall:.1f} s), "
          f"killed at: {headings}")
