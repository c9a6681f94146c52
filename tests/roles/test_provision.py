"""Growing the fleet: a container added to the inventory, `provision.yml` creates it on its node with
its GPUs passed through and what a run needs, `deploy.yml` deploys to it and its run trains; `--check
--diff` before says what it would create and creates nothing, a second run changes nothing, and a
reconcile is refused while the container's run is live.

Two bad-input checks of a create run here through the module's own code against the fleet's node (pct,
pvesm, pvesh and nvidia-smi over the node's ssh), before anything is created. Every bad-input case
through the playbook, a reconcile, a destroy and a provisioning run killed half-way are in
tests/reliability/test_provision_faults.py."""

import pytest

from ansible_collections.dflash.ops.plugins.module_utils.pct_cli import CheckFailed, Pct
from ansible_collections.dflash.ops.plugins.modules.proxmox_container import ARGUMENT_SPEC, provision
from pvesim.fleet import Fleet

pytestmark = [pytest.mark.sim, pytest.mark.slow]

NEW = 201  # on pve1, next to CT 200 (GPUs 0 and 1 of 4)
NEW_VARS = dict(proxmox_provision_gpus=[2, 3], proxmox_provision_cores=2, proxmox_provision_memory=4096,
                proxmox_provision_rootfs_size=8)
CREATE_TASK = "Ensure the container is as the inventory says (created and started when missing)."
TEMPLATE = "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("provision-fleet"), nodes=1, containers=(200,), gpus=4,
              gpu_passthrough={200: [0, 1]})
    f.add_to_inventory("pve1", NEW, **NEW_VARS)
    yield f
    f.down()


@pytest.fixture(scope="module")
def provisioned(fleet):
    """The check run before the container exists, then the run that creates it."""
    check = fleet.play("provision.yml", "-l", f"ct{NEW}", "--check", "--diff")
    exists_after_check = fleet.sim.ssh("pve1", f"pct config {NEW}").returncode == 0
    first = fleet.play("provision.yml", "-l", f"ct{NEW}")
    return check, exists_after_check, first


def config(fleet, vmid=NEW):
    return fleet.sim.ssh("pve1", f"pct config {vmid}").stdout


def test_check_diff_then_provision_then_nothing_changes(fleet, provisioned):
    check, exists_after_check, first = provisioned
    assert check.rc == 0, check
    assert not exists_after_check
    would = check.results(CREATE_TASK)[f"ct{NEW}"]
    assert would["changed"] and would["created"]
    assert "+dev0: /dev/nvidia2,gid=44" in check.stdout and "+rootfs: local-lvm:8" in check.stdout

    assert first.rc == 0, first
    lines = config(fleet).splitlines()
    assert {"dev0: /dev/nvidia2,gid=44", "dev1: /dev/nvidia3,gid=44", "dev2: /dev/nvidiactl,gid=44",
            "cores: 2", "memory: 4096", "unprivileged: 1", "hostname: ct201"} <= set(lines)
    assert f"rootfs: local-lvm:vm-{NEW}-disk-0,size=8G" in lines
    # The container sees its two GPUs, numbered from 0, with the node's UUIDs of GPUs 2 and 3.
    node_uuids = fleet.sim.ssh("pve1", "nvidia-smi --query-gpu=uuid --format=csv,noheader").stdout.split()
    seen = fleet.ct(NEW, "nvidia-smi --query-gpu=index,uuid,driver_version --format=csv,noheader").stdout
    assert seen.splitlines() == [f"0, {node_uuids[2]}, 550.127.05", f"1, {node_uuids[3]}, 550.127.05"]

    again = fleet.play("provision.yml", "-l", f"ct{NEW}", "--diff")
    assert again.rc == 0 and again.stats[f"ct{NEW}"]["changed"] == 0, again


def test_a_provisioned_container_deploys_and_trains_and_is_not_reconciled_under_its_run(fleet, provisioned):
    assert provisioned[2].rc == 0, provisioned[2]
    res = fleet.play("deploy.yml", "-l", f"ct{NEW}")
    assert res.rc == 0, res
    info = fleet.run_info(NEW)
    assert info and fleet.alive(NEW, info["pid"])
    assert '"event": "step"' in fleet.read(NEW, "/var/log/dflash/main.log")
    # The inventory now differs (more cores): a reconcile is refused while the run is live.
    before = config(fleet)
    refused = fleet.play("provision.yml", "-l", f"ct{NEW}", "-e", "proxmox_provision_cores=4",
                         "-e", "proxmox_provision_reconcile=true")
    assert refused.rc != 0 and "has a live training run: nothing was changed" in refused.messages(), refused
    assert config(fleet) == before and fleet.alive(NEW, info["pid"])


def module_params(**overrides):
    params = {key: spec.get("default") for key, spec in ARGUMENT_SPEC.items()}
    params.update(vmid=205, template=TEMPLATE, hostname="ct205", rootfs_size=8, node_name="pve1")
    params.update(overrides)
    return params


# The two checks a create makes from the node's own tools (pvesm path, nvidia-smi) before anything else.
BAD_INPUT = {
    "template missing": (dict(template="local:vztmpl/debian-13-standard_13.1-1_amd64.tar.zst"),
                         "the template local:vztmpl/debian-13-standard_13.1-1_amd64.tar.zst is not on "
                         "node pve1"),
    "GPU the node lacks": (dict(gpus=[3, 9]), "node pve1 has no GPU 9 (/dev/nvidia9); it has /dev/nvidia0, "),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_fails_before_anything_is_left_on_the_node(fleet, case):
    overrides, words = BAD_INPUT[case]
    pct = Pct([*fleet.sim.ssh_argv("pve1"), "/usr/sbin/pct"], "pve1")
    with pytest.raises(CheckFailed) as failed:
        provision(pct, module_params(**overrides), False, dict(changed=False))
    assert words in str(failed.value)
    assert fleet.sim.ssh("pve1", "pct config 205").returncode == 2  # nothing created
