"""pct on the simulated nodes: over real ssh, over real LXC, with Proxmox's formats and messages."""

import json
import os
import uuid

import pytest
from simtools import in_ct

from pvesim import container, node

pytestmark = pytest.mark.sim


def unique(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_file_written_through_pct_exec_exists_in_the_container_only(sim):
    name = unique("written")
    res = sim.ssh("pve1", in_ct(200, "/bin/sh", "-c", f"echo inside > /root/{name}"))
    assert res.returncode == 0, res.stderr
    assert sim.ssh("pve1", in_ct(200, "cat", f"/root/{name}")).stdout == "inside\n"
    assert sim.ssh("pve1", f"test -e /root/{name}").returncode == 1  # not on the node
    assert not os.path.exists(f"/root/{name}")
    assert sim.ssh("pve1", in_ct(201, "test", "-e", f"/root/{name}")).returncode == 1  # nor in CT 201
    delta = node.NodeFiles(sim.state_dir, "pve1").lxcpath / "200" / "delta" / "root" / name
    assert delta.read_text() == "inside\n"  # it lives in CT 200's own layer


def test_a_file_copied_to_the_nodes_root_is_not_in_the_containers_root(sim):
    # The seeds' first failure: patched files copied to the node's /root while the run reads the
    # container's own /root. The container must not see the node's home.
    name = unique("on-node")
    res = sim.ssh("pve1", f"echo node-only > /root/{name}")
    try:
        assert res.returncode == 0, res.stderr
        assert sim.ssh("pve1", in_ct(200, "test", "-e", f"/root/{name}")).returncode == 1
        listing = sim.ssh("pve1", in_ct(200, "ls", "-A", "/root")).stdout.split()
        assert ".bashrc" in listing and ".profile" in listing
    finally:
        os.unlink(f"/root/{name}")


def test_exec_passes_argv_untouched_and_propagates_the_exit_status(sim):
    args = ["a b", "$HOME", "", "'quoted'", "semi;colon"]
    show_argv = "import sys, json; print(json.dumps(sys.argv[1:]))"
    res = sim.ssh("pve1", in_ct(200, "python3", "-c", show_argv, *args))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == args
    assert sim.ssh("pve1", in_ct(200, "/bin/sh", "-c", "exit 7")).returncode == 7


def test_container_has_its_own_hostname_pid_namespace_and_environment(sim):
    script = 'hostname; cat /proc/1/cmdline; echo; echo "$HOME $PATH"'
    res = sim.ssh("pve1", in_ct(200, "/bin/sh", "-c", script))
    hostname, init_cmdline, env = res.stdout.splitlines()
    assert hostname == "ct200"
    assert init_cmdline.split("\0")[1] == container.INIT_PATH
    # pct exec keeps the caller's environment (lxc-attach --keep-env), PATH as pct's CLI handler sets it.
    assert env == "/root /sbin:/bin:/usr/sbin:/usr/bin"
    leaked = sim.ssh("pve1", in_ct(200, "/bin/sh", "-c", "env | grep -c '^SSH_CONNECTION=' || true"))
    assert leaked.stdout.strip() == "1"  # the node's ssh session reaches the container
    cleared = sim.ssh("pve1", "pct exec 200 --keep-env 0 -- /bin/sh -c 'env | grep -c ^SSH_ || true'")
    assert cleared.stdout.strip() == "0"  # --keep-env 0: lxc-attach --clear-env


def test_orphans_are_reaped_not_left_as_zombies(sim):
    # The sleep outlives its shell, is adopted by the container's init and exits: init must reap it.
    sim.ssh("pve1", in_ct(201, "/bin/sh", "-c", "sleep 0.3 >/dev/null 2>&1 & exit 0"))
    res = sim.ssh("pve1", in_ct(201, "/bin/sh", "-c", "sleep 1; ps -eo stat=,comm="))
    states = [line.split()[0] for line in res.stdout.splitlines()]
    assert states and not any(s.startswith("Z") for s in states), res.stdout


def test_list_shows_only_the_nodes_own_containers(sim):
    assert sim.ssh("pve1", "pct list").stdout == (
        "VMID       Status     Lock         Name                \n"
        "200        running                 ct200               \n"
        "201        running                 ct201               \n")
    pve2_list = sim.ssh("pve2", "pct list").stdout.splitlines()
    assert [line.split()[0] for line in pve2_list] == ["VMID", "202", "203"]


def test_unknown_or_foreign_vmid_is_reported_as_proxmox_does(sim):
    for command in ("pct exec 202 -- true", "pct status 202", "pct config 999"):
        res = sim.ssh("pve1", command)
        vmid = command.split()[2]
        assert res.returncode != 0
        assert res.stderr.strip() == f"Configuration file 'nodes/pve1/lxc/{vmid}.conf' does not exist"


def test_status_and_config(sim):
    assert sim.ssh("pve1", "pct status 200").stdout == "status: running\n"
    lines = sim.ssh("pve1", "pct config 200").stdout.splitlines()
    assert "hostname: ct200" in lines
    gpu_devices = sorted(line.split(": ")[1] for line in lines if line.startswith("dev"))
    # CT 200 and CT 201 share pve1's 8 GPUs out: 0..3 to CT 200.
    assert gpu_devices == sorted([f"/dev/nvidia{i}" for i in range(4)]
                                 + ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidiactl"])
    options = [line for line in lines if not line.startswith("lxc.")]
    assert options == sorted(options, key=lambda x: x.partition(":")[0])  # Proxmox sorts the keys


def test_shutdown_start_and_exec_on_a_stopped_container(sim):
    try:
        # A clean shutdown: the init passes the halt on to every process and the container stops.
        sim.ssh("pve1", in_ct(201, "/bin/sh", "-c", "nohup sleep 300 >/dev/null 2>&1 &"))
        res = sim.ssh("pve1", "pct shutdown 201 --timeout 20", timeout=30)
        assert res.returncode == 0, res.stderr
        assert sim.ssh("pve1", "pct status 201").stdout == "status: stopped\n"
        assert "201        stopped" in sim.ssh("pve1", "pct list").stdout
        res = sim.ssh("pve1", in_ct(201, "true"))
        assert res.returncode == 255
        assert res.stderr.strip() == "container '201' not running!"
        res = sim.ssh("pve1", "pct push 201 /etc/hostname /root/x")
        assert (res.returncode, res.stderr.strip()) == (255, "can only push files to a running CT")
        assert sim.ssh("pve1", "pct stop 201").stderr.strip() == "CT 201 not running"
    finally:
        res = sim.ssh("pve1", "pct start 201")
    assert res.returncode == 0, res.stderr
    assert sim.ssh("pve1", "pct status 201").stdout == "status: running\n"
    assert sim.ssh("pve1", "pct start 201").stderr.strip() == "CT 201 already running"
    assert sim.ssh("pve1", in_ct(201, "hostname")).stdout == "ct201\n"
    assert sim.ssh("pve1", "pct stop 201").returncode == 0  # a hard stop
    assert sim.ssh("pve1", "pct status 201").stdout == "status: stopped\n"
    assert sim.ssh("pve1", "pct start 201").returncode == 0


def test_push_and_pull_with_perms_and_owner(sim, tmp_path):
    src = tmp_path / "pushed.txt"
    src.write_text("pushed through pct\n")
    name = unique("pushed")
    res = sim.ssh("pve2", f"pct push 203 {src} /root/{name} --perms 600 --user nobody --group nogroup")
    assert res.returncode == 0, res.stderr
    stat = sim.ssh("pve2", in_ct(203, "stat", "-c", "%a %U %G", f"/root/{name}")).stdout
    assert stat == "600 nobody nogroup\n"
    pulled = tmp_path / "pulled.txt"
    res = sim.ssh("pve2", f"pct pull 203 /root/{name} {pulled} --perms 0640")
    assert res.returncode == 0, res.stderr
    assert pulled.read_text() == "pushed through pct\n"
    assert oct(pulled.stat().st_mode & 0o777) == "0o640"
    res = sim.ssh("pve2", f"pct pull 203 /root/absent-{name} {tmp_path / 'never'}")
    assert res.returncode == 255
    assert res.stderr.strip() == f"failed to open /root/absent-{name}: No such file or directory"


def test_container_processes_carry_their_vmid_in_the_cgroup_path(sim):
    files = node.NodeFiles(sim.state_dir, "pve2")
    pid = container.init_pid(files, 203)
    paths = [line.split(":", 2)[2] for line in open(f"/proc/{pid}/cgroup").read().splitlines()]
    assert paths and all("/lxc/203/" in p + "/" for p in paths), paths


def test_pct_help_and_usage_errors(sim):
    assert sim.ssh("pve1", "pct help").stdout.startswith("USAGE: pct <COMMAND>")
    res = sim.ssh("pve1", "pct frobnicate 200")
    assert res.returncode == 255 and "unknown command 'pct frobnicate'" in res.stderr
    res = sim.ssh("pve1", "pct status abc")
    assert res.returncode == 255 and "vmid: invalid format" in res.stderr
