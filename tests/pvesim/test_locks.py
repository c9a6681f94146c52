"""A container config's `lock:` and the HA manager as pve-container keeps them (docs/PVESIM.md, "Locks
and HA", one test a row): a backup's lock refuses start, set, shutdown, stop and destroy in pct's words
while `pct exec` goes on; vzdump holds `lock: backup` while it runs and removes it when it ends or is
stopped; a boot's startall removes only a left-over backup lock; a killed `pct create` leaves `lock:
create`, which `pct unlock` removes; an HA-managed container's start and shutdown only queue a request;
`pct set` of a missing device writes nothing."""

import json
import os
import signal
import subprocess

import pytest

import pvesim
from tests.pvesim.simtools import container_conf, lone_node
from tests.waiting import wait_for

pytestmark = pytest.mark.sim

TEMPLATE = "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"


@pytest.fixture(scope="module")
def lone(tmp_path_factory):
    """A node of its own (2 GPUs; CT 300 and 301 given one each), which the tests change."""
    s = lone_node(tmp_path_factory, "locks", (300, 301), 2)
    yield s
    pvesim.down(s.state_dir)


def pct(sim, command):
    return sim.ssh("pve1", f"pct {command}")


def running(sim, vmid):
    return pct(sim, f"status {vmid}").stdout.strip() == "status: running"


def set_lock(sim, vmid, lock):
    """Write `lock: <lock>` into the config, as a task that holds one leaves it."""
    path = container_conf(sim, vmid)
    lines = [line for line in path.read_text().splitlines() if not line.startswith("lock:")]
    options = sorted([line for line in lines if not line.startswith(("#", "lxc."))]
                     + ([f"lock: {lock}"] if lock else []))
    path.write_text("\n".join([*(line for line in lines if line.startswith("#")), *options,
                               *(line for line in lines if line.startswith("lxc."))]) + "\n")


def lock_of(sim, vmid):
    return next((line.split(": ", 1)[1] for line in container_conf(sim, vmid).read_text().splitlines()
                 if line.startswith("lock: ")), None)


def ensure(sim, vmid, state):
    set_lock(sim, vmid, None)
    if running(sim, vmid) != (state == "running"):
        assert pct(sim, f"{'start' if state == 'running' else 'stop'} {vmid}").returncode == 0


def test_a_running_backup_locks_the_container_and_pct_refuses_in_its_words(lone):
    ensure(lone, 300, "running")
    # 1 MiB the container wrote, read at 1 KiB/s: the backup runs until it is stopped.
    assert pct(lone, "exec 300 -- dd if=/dev/zero of=/root/blob bs=64k count=16").returncode == 0
    backup = subprocess.Popen([*lone.ssh_argv("pve1"), "vzdump 300 --bwlimit 1"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(lambda: lock_of(lone, 300) == "backup", timeout=30)
        before = container_conf(lone, 300).read_text()
        for command in ("set 300 --cores 3", "shutdown 300", "stop 300", "destroy 300"):
            res = pct(lone, command)
            assert (res.returncode, res.stderr) == (255, "CT is locked (backup)\n"), command
        assert container_conf(lone, 300).read_text() == before and running(lone, 300)
        assert pct(lone, "exec 300 -- true").returncode == 0  # pct.pm exec reads no lock
        rows = [row.split()[:3] for row in pct(lone, "list").stdout.splitlines()]
        assert ["300", "running", "backup"] in rows
        resources = json.loads(lone.ssh("pve1", "pvesh get /cluster/resources --type vm --output-format json")
                               .stdout)
        assert next(r for r in resources if r["vmid"] == 300)["lock"] == "backup"
        stopped = lone.ssh("pve1", "vzdump --stop 1")
        assert stopped.returncode == 0, stopped.stderr
        _, said = backup.communicate(timeout=30)
    finally:
        if backup.poll() is None:
            backup.kill()
            backup.wait()
    assert backup.returncode == 255 and "ERROR: Backup of VM 300 failed - interrupted by signal" in said
    assert lock_of(lone, 300) is None
    dump = lone.state_dir / "nodes" / "pve1" / "storage" / "local" / "dump"
    assert not list(dump.glob("vzdump-lxc-300-*"))  # the interrupted archive is gone


def test_a_backup_that_ends_removes_its_lock_and_leaves_its_archive(lone):
    ensure(lone, 301, "running")
    res = lone.ssh("pve1", "vzdump 301 --storage local")
    assert res.returncode == 0, res.stderr
    assert "INFO: Finished Backup of VM 301" in res.stderr and lock_of(lone, 301) is None
    dump = lone.state_dir / "nodes" / "pve1" / "storage" / "local" / "dump"
    assert [p.suffix for p in dump.glob("vzdump-lxc-301-*")] == [".tar"]
    set_lock(lone, 301, "create")
    refused = lone.ssh("pve1", "vzdump 301")
    assert refused.returncode == 255
    assert "ERROR: Backup of VM 301 failed - CT is locked (create)" in refused.stderr
    assert lock_of(lone, 301) == "create"  # not the backup's to remove
    set_lock(lone, 301, None)


def test_a_locked_start_is_refused_unless_skiplock(lone):
    ensure(lone, 301, "stopped")
    set_lock(lone, 301, "backup")
    res = pct(lone, "start 301")
    assert (res.returncode, res.stderr) == (255, "CT is locked (backup)\n") and not running(lone, 301)
    assert pct(lone, "start 301 --skiplock 1").returncode == 0 and running(lone, 301)
    ensure(lone, 301, "stopped")


def test_startall_removes_a_left_over_backup_lock_and_no_other(lone):
    ensure(lone, 300, "stopped")
    ensure(lone, 301, "stopped")
    for vmid, lock in ((300, "backup"), (301, "create")):
        assert pct(lone, f"set {vmid} --onboot 1").returncode == 0
        set_lock(lone, vmid, lock)
    try:
        res = lone.ssh("pve1", "pvesh --nooutput create /nodes/localhost/startall", timeout=120)
        assert res.returncode == 0, res.stderr
        assert "removed left over backup lock from '300'!" in res.stderr
        assert "Starting CT 301 failed: CT is locked (create)" in res.stderr
        assert running(lone, 300) and lock_of(lone, 300) is None
        assert not running(lone, 301) and lock_of(lone, 301) == "create"
    finally:
        for vmid in (300, 301):
            set_lock(lone, vmid, None)
            pct(lone, f"set {vmid} --onboot 0")


def test_a_killed_create_leaves_lock_create_which_only_unlock_removes(lone):
    cache = lone.state_dir / "nodes" / "pve1" / "storage" / "local" / "template" / "cache"
    slow = cache / "debian-12-slow_12.7-1_amd64.tar.zst"
    os.mkfifo(slow)  # an archive that is still being read: the create waits on it
    env = dict(os.environ, PVESIM_STATE_DIR=str(lone.state_dir), PVESIM_NODE="pve1")
    create = subprocess.Popen(["/usr/sbin/pct", "create", "302", f"local:vztmpl/{slow.name}", "--rootfs",
                               "local-lvm:4"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert wait_for(lambda: container_conf(lone, 302).exists() and lock_of(lone, 302) == "create",
                        timeout=30)
        create.send_signal(signal.SIGKILL)
        create.wait(timeout=30)
    finally:
        if create.poll() is None:
            create.kill()
            create.wait()
        slow.unlink()
    assert container_conf(lone, 302).read_text() == "lock: create\n"
    for command in ("start 302", "destroy 302", "set 302 --cores 2"):
        res = pct(lone, command)
        assert (res.returncode, res.stderr) == (255, "CT is locked (create)\n"), command
    assert pct(lone, "unlock 302").returncode == 0 and lock_of(lone, 302) is None
    again = pct(lone, "unlock 302")
    assert (again.returncode, again.stderr) == (255, "no lock found trying to remove any lock\n")
    assert pct(lone, "destroy 302").returncode == 0 and not container_conf(lone, 302).exists()


def test_set_of_a_device_the_node_lacks_is_refused_and_nothing_written(lone):
    before = container_conf(lone, 300).read_text()
    res = pct(lone, "set 300 --cores 3 --dev5 /dev/nvidia7")
    assert (res.returncode, res.stderr) == (2, "Device /dev/nvidia7 does not exist\n")
    assert container_conf(lone, 300).read_text() == before


def test_an_ha_managed_container_s_start_and_shutdown_only_queue_a_request(lone):
    ensure(lone, 300, "running")
    ensure(lone, 301, "stopped")
    ha = lone.state_dir / "pve" / "ha"
    ha.mkdir(parents=True, exist_ok=True)
    (ha / "resources.cfg").write_text("ct: 301\n\tstate stopped\n\nct: 300\n\tstate started\n\n")
    try:
        assert pct(lone, "set 301 --onboot 1").returncode == 0
        res = pct(lone, "start 301")
        assert (res.returncode, res.stdout) == (0, "Requesting HA start for CT 301\n")
        assert not running(lone, 301) and "ct: 301\n\tstate started\n" in (ha / "resources.cfg").read_text()
        resources = json.loads(lone.ssh("pve1", "pvesh get /cluster/resources --output-format json").stdout)
        assert next(r for r in resources if r["vmid"] == 301)["hastate"] == "started"
        boot = lone.ssh("pve1", "pvesh --nooutput create /nodes/localhost/startall", timeout=120)
        assert boot.returncode == 0 and "CT 301" not in boot.stderr and not running(lone, 301)

        res = pct(lone, "shutdown 300 --timeout 30")
        assert (res.returncode, res.stdout) == (0, "Requesting HA stop for CT 300\n") and running(lone, 300)
        assert (ha / "crm_commands").read_text() == "stop ct:300 30\n"
        res = pct(lone, "destroy 301")
        assert (res.returncode, res.stderr) == (
            255, "unable to remove CT 301 - used in HA resources and purge parameter not set.\n")
    finally:
        (ha / "resources.cfg").unlink()
        (ha / "crm_commands").unlink(missing_ok=True)
        pct(lone, "set 301 --onboot 0")
