"""Simulated GPUs in real containers: node devices held by live processes through CUDA_VISIBLE_DEVICES,
each container seeing only the GPUs passed through to it, numbered from 0."""

import re

import pytest
from simtools import host_pid, in_ct

from pvesim import container, node
from pvesim.sim import gpu_layout, split_containers
from tests.waiting import wait_for

pytestmark = pytest.mark.sim

APPS = ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"]
MEMORY = ["nvidia-smi", "--query-gpu=index,memory.used,utilization.gpu", "--format=csv,noheader,nounits"]


def start_in_ct(sim, node_name, vmid, script):
    """Start a background shell script in a container; return (container pid, host pid)."""
    res = sim.ssh(node_name, in_ct(vmid, "/bin/sh", "-c", f"{script} >/dev/null 2>&1 & echo $!"))
    assert res.returncode == 0, res.stderr
    ct_pid = int(res.stdout)
    init = container.init_pid(node.NodeFiles(sim.state_dir, node_name), vmid)
    return ct_pid, host_pid(init, ct_pid)


def uuids(sim, node_name, vmid):
    out = sim.ssh(node_name, in_ct(vmid, "nvidia-smi", "-L")).stdout
    return re.findall(r"\(UUID: (GPU-[0-9a-f-]+)\)", out)


def test_list_gpus_format(sim):
    out = sim.ssh("pve1", in_ct(200, "nvidia-smi", "-L")).stdout.splitlines()
    assert len(out) == 4
    uuid = r"GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}"
    for i, line in enumerate(out):
        assert re.fullmatch(rf"GPU {i}: NVIDIA H200 \(UUID: {uuid}\)", line), line
    # Disjoint shares of the node's GPUs, renumbered from 0 in each container, with the physical UUIDs.
    node = re.findall(r"\(UUID: (GPU-[0-9a-f-]+)\)", sim.ssh("pve1", "nvidia-smi -L").stdout)
    assert len(node) == 8
    assert uuids(sim, "pve1", 200) == node[:4] and uuids(sim, "pve1", 201) == node[4:]
    assert not set(uuids(sim, "pve1", 200)) & set(uuids(sim, "pve2", 202))


@pytest.mark.slow
def test_a_process_holds_gpu0_while_it_runs_with_its_host_pid(sim):
    gpu0 = uuids(sim, "pve1", 200)[0]
    holder = "CUDA_VISIBLE_DEVICES=0 PVESIM_GPU_MEMORY_MIB=3000 exec sleep 60"
    ct_pid, pid = start_in_ct(sim, "pve1", 200, holder)
    assert pid and pid != ct_pid  # the host sees another pid than the container
    try:
        assert sim.ssh("pve1", in_ct(200, *APPS)).stdout == f"{pid}, {gpu0}, 3000\n"
        memory = sim.ssh("pve1", in_ct(200, *MEMORY)).stdout.splitlines()
        assert memory[0] == "0, 3000, 100"
        assert memory[1:] == [f"{i}, 0, 0" for i in range(1, 4)]
        # CT 201 has other GPUs: it sees neither the process nor its memory.
        assert sim.ssh("pve1", in_ct(201, *APPS)).stdout == ""
        assert sim.ssh("pve1", in_ct(201, *MEMORY)).stdout.splitlines()[0] == "0, 0, 0"
        # On the node, nvidia-smi shows every container's processes; the pid maps to CT 200 by cgroup.
        assert f"{pid}, {gpu0}, 3000" in sim.ssh("pve1", " ".join(APPS)).stdout
        assert "/lxc/200/" in open(f"/proc/{pid}/cgroup").read()
        assert str(pid) not in sim.ssh("pve2", " ".join(APPS)).stdout
    finally:
        sim.ssh("pve1", in_ct(200, "kill", str(ct_pid)))
    assert wait_for(lambda: sim.ssh("pve1", in_ct(200, *APPS)).stdout == "")
    assert sim.ssh("pve1", in_ct(200, *MEMORY)).stdout.splitlines()[0] == "0, 0, 0"


def test_a_zombie_holds_no_gpu(sim):
    # The parent (without CUDA_VISIBLE_DEVICES) never waits for its child, which holds GPU 1 and exits.
    parent = ("exec python3 -c \"import subprocess, time; "
              "subprocess.Popen(['sleep', '0.2'], env={'CUDA_VISIBLE_DEVICES': '1'}); time.sleep(60)\"")
    ct_pid, _ = start_in_ct(sim, "pve2", 202, parent)
    try:
        def zombie_present():
            states = sim.ssh("pve2", in_ct(202, "ps", "-o", "stat=", "--ppid", str(ct_pid))).stdout.split()
            return states and all(s.startswith("Z") for s in states)
        assert wait_for(zombie_present)
        assert sim.ssh("pve2", in_ct(202, *APPS)).stdout == ""
        assert sim.ssh("pve2", in_ct(202, *MEMORY)).stdout.splitlines()[1] == "1, 0, 0"
    finally:
        sim.ssh("pve2", in_ct(202, "kill", str(ct_pid)))


def test_query_gpu_with_header_and_units(sim):
    out = sim.ssh("pve2", in_ct(203, "nvidia-smi", "--query-gpu=index,uuid,name,memory.used,memory.total,"
                                "utilization.gpu", "--format=csv")).stdout.splitlines()
    assert out[0] == "index, uuid, name, memory.used [MiB], memory.total [MiB], utilization.gpu [%]"
    assert re.fullmatch(r"3, GPU-[0-9a-f-]{36}, NVIDIA H200, 0 MiB, 143771 MiB, 0 %", out[4])


def test_without_gpus_no_devices_are_found(sim_factory):
    bare = sim_factory(nodes=1, containers=(300,), gpus=0)
    res = bare.ssh("pve1", in_ct(300, "nvidia-smi", "-L"))
    # No GPU passed through, not even /dev/nvidiactl: nvidia-smi cannot reach the driver.
    assert res.returncode == 9 and "couldn't communicate with the NVIDIA driver" in res.stdout
    assert "dev0:" not in bare.ssh("pve1", "pct config 300").stdout


@pytest.mark.parametrize("compute_apps", ["host", "container"])
def test_a_gpu_two_containers_share_is_one_device(sim_factory, compute_apps):
    """CT 310 and CT 311 are both given node GPU 1 (their GPU 1 and GPU 0): memory and utilization are
    the device's; the compute-apps list is the driver's choice."""
    shared = sim_factory(nodes=1, containers=(310, 311), gpus=2, gpu_passthrough={310: [0, 1], 311: [1]},
                         compute_apps=compute_apps)
    holder = "CUDA_VISIBLE_DEVICES=1 PVESIM_GPU_MEMORY_MIB=700 exec sleep 60"
    ct_pid, pid = start_in_ct(shared, "pve1", 310, holder)
    try:
        assert shared.ssh("pve1", in_ct(311, *MEMORY)).stdout == "0, 700, 100\n"
        apps = shared.ssh("pve1", in_ct(311, *APPS)).stdout
        gpu = uuids(shared, "pve1", 311)[0]
        assert apps == (f"{pid}, {gpu}, 700\n" if compute_apps == "host" else "")
        own = shared.ssh("pve1", in_ct(310, *APPS)).stdout
        assert own == f"{pid if compute_apps == 'host' else ct_pid}, {gpu}, 700\n"
        assert shared.ssh("pve1", " ".join(APPS)).stdout == f"{pid}, {gpu}, 700\n"  # the node: host PIDs
    finally:
        shared.ssh("pve1", in_ct(310, "kill", str(ct_pid)))


def test_the_default_layout_never_gives_two_containers_one_gpu():
    """Without gpu_passthrough every container's GPUs are its own: the session sim, the fleets of the
    tests and the benchmarks (any node and container count) share no GPU unless a test says so."""
    for nodes in (1, 2, 3):
        for count in range(1, 11):
            blocks = split_containers(list(range(200, 200 + count)), nodes)
            for gpus in (0, 1, 2, 8, 16):
                layout = gpu_layout(blocks, gpus)
                for block in blocks:
                    given = [i for vmid in block for i in layout[vmid]]
                    assert len(given) == len(set(given)) and set(given) <= set(range(gpus)), (blocks, layout)
    shared = gpu_layout([[200, 201]], 8, {201: [0, 1]})
    assert shared == {200: [0, 1, 2, 3], 201: [0, 1]}
