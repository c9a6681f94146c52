"""pct as Proxmox runs it (docs/PVESIM.md, one test a row): config output, names, vmids, exit codes,
root only, create/set/destroy, and a passthrough naming a device the node lacks."""

import pwd

import pytest
from simtools import in_ct

from ansible_collections.dflash.ops.plugins.modules.pct_container_check import CheckFailed, Pct, check

pytestmark = pytest.mark.sim


@pytest.fixture(scope="module")
def lone(tmp_path_factory):
    """A node of its own (2 GPUs, CT 400 given both), which the tests change."""
    import pvesim
    s = pvesim.up(nodes=1, containers=(400,), gpus=2, state_dir=tmp_path_factory.mktemp("strict") / "state",
                  inventory=tmp_path_factory.mktemp("strict-inv") / "hosts.yml")
    yield s
    pvesim.down(s.state_dir)


def test_config_sorts_keys_prints_lxc_entries_and_stops_at_a_snapshot(lone):
    conf = lone.state_dir / "nodes" / "pve1" / "pve" / "lxc" / "400.conf"
    original = conf.read_text()
    try:
        conf.write_text("#a note\nswap: 0\narch: amd64\n"
                        "lxc.mount.entry = /dev/nvidia0 dev/nvidia0 none bind\nhostname: ct400\n"
                        "\n[before]\narch: i386\nmemory: 1\n")
        assert lone.ssh("pve1", "pct config 400").stdout.splitlines() == [
            "arch: amd64", "description: a note", "hostname: ct400", "swap: 0",
            "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind"]
    finally:
        conf.write_text(original)


def test_vmids_are_validated_and_a_missing_config_exits_with_enoent(lone):
    res = lone.ssh("pve1", "pct status 0400")
    assert res.returncode == 255 and "vmid: invalid format - value '0400'" in res.stderr
    res = lone.ssh("pve1", "pct status 499")
    missing = "Configuration file 'nodes/pve1/lxc/499.conf' does not exist\n"
    assert (res.returncode, res.stderr) == (2, missing)


def test_pct_runs_as_root_only(lone):
    nobody = pwd.getpwnam("nobody")
    res = lone.ssh("pve1", f"setpriv --reuid={nobody.pw_uid} --regid={nobody.pw_gid} --clear-groups "
                           "/usr/sbin/pct status 400")
    assert (res.returncode, res.stderr) == (255, "please run as root\n")


def test_create_set_list_and_destroy(lone):
    template = "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"
    res = lone.ssh("pve1", f"pct create 401 {template} --cores 2 --memory 1024 --swap 0 --rootfs local-lvm:8 "
                           "--unprivileged 1 --onboot 0 --net0 name=eth0,bridge=vmbr0,ip=dhcp")
    assert res.returncode == 0, res.stderr
    config = lone.ssh("pve1", "pct config 401").stdout.splitlines()
    assert "rootfs: local-lvm:vm-401-disk-0,size=8G" in config and "unprivileged: 1" in config
    rows = [line.split() for line in lone.ssh("pve1", "pct list").stdout.splitlines()]
    assert ["401", "stopped", "CT401"] in rows  # no hostname: named CT<vmid>
    again = lone.ssh("pve1", f"pct create 401 {template}")
    assert again.returncode == 255 and "CT 401 already exists on node 'pve1'" in again.stderr
    assert "bogus" in lone.ssh("pve1", "pct create 402 local:vztmpl/bogus.tar.zst").stderr
    lone.add_vm("pve1", 450)  # vmids are cluster-wide: a VM's is taken for containers too
    taken = lone.ssh("pve1", f"pct create 450 {template}")
    assert (taken.returncode, taken.stderr) == (255, "VM 450 already exists on node 'pve1'\n")
    assert lone.ssh("pve1", "pct set 401 --hostname trainer --dev0 /dev/nvidia1").returncode == 0
    assert lone.ssh("pve1", "pct start 401").returncode == 0
    assert lone.ssh("pve1", in_ct(401, "hostname")).stdout.strip() == "CT401"  # named at create
    refused = lone.ssh("pve1", "pct destroy 401")
    assert (refused.returncode, refused.stderr) == (255, "unable to destroy CT 401 - container is running\n")
    assert lone.ssh("pve1", "pct stop 401 && pct destroy 401").returncode == 0
    assert "401" not in lone.ssh("pve1", "pct list").stdout


def test_a_passthrough_of_a_missing_device_fails_the_start_and_the_check_says_so(lone):
    assert lone.ssh("pve1", "pct stop 400").returncode == 0
    # Written while the device was there, or by hand: pct set refuses a device the node lacks
    # (tests/pvesim/test_locks.py::test_set_of_a_device_the_node_lacks_is_refused_and_nothing_written).
    conf = lone.state_dir / "nodes" / "pve1" / "pve" / "lxc" / "400.conf"
    conf.write_text(conf.read_text() + "dev9: /dev/nvidia7\n")
    try:
        res = lone.ssh("pve1", "pct start 400")
        assert (res.returncode, res.stderr) == (2, "Device /dev/nvidia7 does not exist\n")
        # The product's node check, its pct reached over the node's ssh.
        pct = Pct([*lone.ssh_argv("pve1"), "/usr/sbin/pct"], "pve1")
        params = dict(vmid=400, start_stopped=True, require_gpu_passthrough=True, required_gpus=[0])
        with pytest.raises(CheckFailed) as failed:
            check(pct, params, False, dict(changed=False, status=None, started=False, gpu_count=None))
        assert str(failed.value).startswith("CT 400 on node pve1 did not start (pct start 400, exit 2): "
                                            "Device /dev/nvidia7 does not exist.")
    finally:
        lone.ssh("pve1", "pct set 400 --delete dev9 && pct start 400")
    assert lone.ssh("pve1", "pct status 400").stdout == "status: running\n"


def test_a_bind_mount_of_a_missing_device_fails_lxc_start_with_no_such_file(lone):
    conf = lone.state_dir / "nodes" / "pve1" / "pve" / "lxc" / "400.conf"
    original = conf.read_text()
    assert lone.ssh("pve1", "pct stop 400").returncode == 0
    try:
        conf.write_text(original + "lxc.mount.entry: /dev/nvidia-caps dev/nvidia-caps none bind,create=dir\n")
        res = lone.ssh("pve1", "pct start 400")
        assert res.returncode == 255
        assert 'No such file or directory - Failed to mount "/dev/nvidia-caps"' in res.stderr
        assert res.stderr.endswith("command 'systemctl start pve-container@400' failed: exit code 1\n")
        conf.write_text(original + "lxc.mount.entry: /dev/nvidia-caps dev/nvidia-caps none bind,optional\n")
        assert lone.ssh("pve1", "pct start 400").returncode == 0  # optional: skipped
    finally:
        conf.write_text(original)
