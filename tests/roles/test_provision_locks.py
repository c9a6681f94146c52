"""Provisioning (proxmox_container, the provision role's module) and the node check (pct_container_check,
what deploy.yml and restart_training.yml run first) on a pvesim node whose container is locked or
HA-managed, through the modules' own code over the node's ssh: a start, a reconcile or a destroy that a
lock forbids is refused before anything runs, naming the lock and what to do (nothing changes on the
node); with nothing to change, provisioning goes on with a warning, and so does the node check of a
running locked container (the run's stop and start need only pct exec); an HA-managed container is not
started, and no request is queued with the HA manager."""

import pytest

import pvesim
from ansible_collections.dflash.ops.plugins.module_utils.pct_cli import CheckFailed, Pct
from ansible_collections.dflash.ops.plugins.modules import pct_container_check
from ansible_collections.dflash.ops.plugins.modules.proxmox_container import ARGUMENT_SPEC, provision
from tests.pvesim.simtools import container_conf, lone_node

pytestmark = pytest.mark.sim

TEMPLATE = "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"
BACKUP_ADVICE = ("A backup (vzdump) of it is running: wait for it to end, then run this again (its task on "
                 "the node, or `vzdump --stop 1` there to end it). A backup killed outright leaves the lock, "
                 "which the node's next boot removes.")


@pytest.fixture(scope="module")
def lone(tmp_path_factory):
    """A node of its own (no GPUs; CT 300 and 301), which the tests lock and unlock."""
    s = lone_node(tmp_path_factory, "provision-locks", (300, 301), 0)
    yield s
    pvesim.down(s.state_dir)


def running(sim, vmid):
    return sim.ssh("pve1", f"pct status {vmid}").stdout.strip() == "status: running"


@pytest.fixture
def node(lone):
    """CT 300 and 301 stopped and unlocked before and after each test, no HA resource."""
    def reset():
        for vmid in (300, 301):
            lines = container_conf(lone, vmid).read_text().splitlines()
            kept = [line for line in lines if not line.startswith("lock:")]
            container_conf(lone, vmid).write_text("".join(f"{line}\n" for line in kept))
            if running(lone, vmid):
                assert lone.ssh("pve1", f"pct stop {vmid}").returncode == 0
        (lone.state_dir / "pve" / "ha" / "resources.cfg").unlink(missing_ok=True)
    reset()
    yield lone
    reset()


def lock(sim, vmid, name):
    """`lock: <name>` in the config, where pve-container writes it (the options sorted)."""
    lines = container_conf(sim, vmid).read_text().splitlines()
    options = sorted([*(line for line in lines if not line.startswith("lxc.")), f"lock: {name}"])
    container_conf(sim, vmid).write_text("".join(f"{line}\n" for line in [*options, *(line for line in lines
                                                                           if line.startswith("lxc."))]))


def params(vmid, **overrides):
    p = {key: spec.get("default") for key, spec in ARGUMENT_SPEC.items()}
    p.update(vmid=vmid, template=TEMPLATE, hostname=f"ct{vmid}", rootfs_size=8, node_name="pve1")
    p.update(overrides)
    return p


def pct(sim):
    return Pct([*sim.ssh_argv("pve1"), "/usr/sbin/pct"], "pve1")


def provision_fails(sim, p):
    with pytest.raises(CheckFailed) as failed:
        provision(pct(sim), p, False, dict(changed=False))
    return str(failed.value)


def test_a_backup_lock_refuses_the_start_and_the_reconcile_and_nothing_changes(node):
    lock(node, 300, "backup")
    before = container_conf(node, 300).read_text()
    assert provision_fails(node, params(300)) == (
        "CT 300 on node pve1 is locked (backup): pve-container refuses pct start 300 until the lock goes, so "
        "nothing was changed. " + BACKUP_ADVICE)
    assert not running(node, 300)
    assert node.ssh("pve1", "pct start 300 --skiplock 1").returncode == 0
    assert provision_fails(node, params(300, cores=3, reconcile=True)).startswith(
        "CT 300 on node pve1 is locked (backup): pve-container refuses pct set 300 until the lock goes, so "
        "nothing was changed.")
    assert provision_fails(node, params(300, state="absent")).startswith(
        "CT 300 on node pve1 is locked (backup): pve-container refuses pct destroy 300 until")
    assert container_conf(node, 300).read_text() == before and running(node, 300)


def test_with_nothing_to_change_provisioning_goes_on_and_says_the_lock(node):
    assert node.ssh("pve1", "pct start 300").returncode == 0
    lock(node, 300, "backup")
    result = dict(changed=False)
    provision(pct(node), params(300), False, result)
    assert result["changed"] is False and result["lock"] == "backup"
    assert any(w.startswith("CT 300 on node pve1 is locked (backup): provisioning changes nothing of its "
                            "config and goes on in it through pct exec, which no lock refuses")
               for w in result["warnings"]), result["warnings"]


def test_a_stale_create_lock_is_refused_with_the_unlock_advice(node):
    lock(node, 301, "create")
    assert provision_fails(node, params(301, start=False)) == (
        "CT 301 on node pve1 is locked (create): pve-container refuses pct start, set and destroy of CT 301 "
        "until the lock goes, so nothing was changed. A `pct create 301` did not finish (killed or failed "
        "half-way), or is still running: once no `pct create 301` runs on the node, `pct unlock 301` and "
        "`pct destroy 301` there remove the half-made container, and provisioning creates it again.")


def test_an_ha_managed_container_is_not_started_and_no_request_is_queued(node):
    ha = node.state_dir / "pve" / "ha"
    ha.mkdir(parents=True, exist_ok=True)
    (ha / "resources.cfg").write_text("ct: 301\n\tstate stopped\n\n")
    assert provision_fails(node, params(301)).startswith(
        "CT 301 on node pve1 is managed by the HA manager (its HA state: stopped): pct start 301 only queues "
        "a request with it and returns, so this does not do it.")
    assert (ha / "resources.cfg").read_text() == "ct: 301\n\tstate stopped\n\n" and not running(node, 301)
    assert provision_fails(node, params(301, state="absent")) == (
        "CT 301 on node pve1 is an HA resource (its HA state: stopped): pct destroy refuses it without "
        "--purge, and its shutdown would only queue a request with the HA manager, so nothing was changed. "
        "Take it out of HA first (`ha-manager remove ct:301` on the node).")
    assert container_conf(node, 301).exists()


def check(sim, vmid, **overrides):
    p = {"vmid": vmid, "start_stopped": True, "require_gpu_passthrough": False, "required_gpus": [],
         **overrides}
    result = dict(changed=False, status=None, started=False, gpu_count=None, lock=None)
    pct_container_check.check(pct(sim), p, False, result)
    return result


def test_the_node_check_starts_no_locked_container_and_says_the_lock_of_a_running_one(node):
    lock(node, 300, "backup")
    with pytest.raises(CheckFailed) as failed:
        check(node, 300)
    assert str(failed.value).startswith("CT 300 on node pve1 is locked (backup): pve-container refuses pct "
                                        "start 300") and not running(node, 300)
    assert node.ssh("pve1", "pct start 300 --skiplock 1").returncode == 0
    result = check(node, 300)
    assert result["lock"] == "backup" and result["warnings"][0].startswith(
        "CT 300 on node pve1 is locked (backup): the run's stop and start go on through pct exec")
    assert node.ssh("pve1", "pct exec 300 -- true").returncode == 0


def test_the_node_check_of_an_ha_managed_container_fails_with_the_reason(node):
    ha = node.state_dir / "pve" / "ha"
    ha.mkdir(parents=True, exist_ok=True)
    (ha / "resources.cfg").write_text("ct: 301\n\tstate stopped\n\n")
    with pytest.raises(CheckFailed) as failed:
        check(node, 301)
    assert str(failed.value).startswith(
        "CT 301 on node pve1 is managed by the HA manager: pct start 301 only queued a request with it "
        "(Requesting HA start for CT 301) and returned: the container is not running.")
    assert not running(node, 301)
