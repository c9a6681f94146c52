"""Unit tests of the GPU judging that gpu_verify and training_run's start share (module_utils/gpu_state:
judging the GPUs, mapping processes to containers) on nvidia-smi output as real machines print it."""

from __future__ import annotations

import pytest
from test_nvidia_smi import H100_APPS, H100_BUSY, H100_IDLE, PLACEHOLDER_ROWS

from ansible_collections.dflash.ops.plugins.module_utils import gpu_state as gv
from ansible_collections.dflash.ops.plugins.module_utils.gpu_owners import vmid_from_cgroup
from ansible_collections.dflash.ops.plugins.module_utils.nvidia_smi import COMPUTE_APPS, GPU_LOAD


def snapshot(gpu_output, apps_output=""):
    gpus = GPU_LOAD.parse(gpu_output)
    return gpus, gv.with_gpu_index(COMPUTE_APPS.parse(apps_output), gpus)


def test_processes_get_their_gpu_index():
    assert snapshot(H100_BUSY, H100_APPS)[1] == [
        {"pid": 81234, "gpu_uuid": "GPU-9f1d7c2a-4c0b-7a5e-3b1f-2d8e6a4c9b10", "gpu_index": 0,
         "used_memory_mib": 61220, "vmid": None, "container_pid": None}]
    # A MIG instance's uuid names no full GPU: the process stays, without an index.
    assert snapshot(H100_BUSY, "7, MIG-1234, 100\n")[1][0]["gpu_index"] is None


@pytest.mark.parametrize(
    "cgroup, vmid",
    [
        ("0::/lxc/200/ns/init.scope\n", 200),                                 # Proxmox, cgroup v2
        ("0::/lxc/201/ns\n", 201),
        ("12:memory:/lxc/202\n11:pids:/lxc/202\n0::/\n", 202),                # cgroup v1
        ("0::/lxc.payload.203/system.slice/x.service\n", 203),                # plain LXC
        ("0::/pvesim-ab12/lxc/204/ns/user\n", 204),                           # nested under a parent
        ("0::/lxc.monitor/200\n", None),                                      # the monitor, not the CT
        ("0::/lxc.monitor.200\n", None),
        ("0::/system.slice/sshd.service\n", None),
        ("0::/user.slice/lxc/notanumber\n", None),
        ("", None),
    ],
)
def test_vmid_from_cgroup(cgroup, vmid):
    assert vmid_from_cgroup(cgroup) == vmid


def test_container_pid_is_the_innermost_nspid():
    assert gv.container_pid("Name:\tpython\nNSpid:\t81234\t57\n") == 57
    assert gv.container_pid("NSpid:\t4242\n") == 4242
    assert gv.container_pid(None) is None


def test_map_containers_reads_the_cgroup_of_each_pid(tmp_path):
    for pid, cgroup, nspid in ((81234, "0::/lxc/200/ns\n", "81234\t57"), (900, "0::/user.slice\n", "900")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cgroup").write_text(cgroup)
        (tmp_path / str(pid) / "status").write_text(f"Name:\tx\nNSpid:\t{nspid}\n")
    processes = [{"pid": p, "vmid": None, "container_pid": None} for p in (81234, 900, 5555)]
    gv.map_containers(processes, proc_root=str(tmp_path))
    assert [(p["vmid"], p["container_pid"]) for p in processes] == [(200, 57), (None, None), (None, None)]


def test_inside_lxc(tmp_path):
    (tmp_path / "self").mkdir()
    (tmp_path / "1").mkdir()
    (tmp_path / "self" / "cgroup").write_text("0::/.lxc\n")
    (tmp_path / "1" / "environ").write_text("PATH=/bin\0container=lxc\0")
    assert gv.inside_lxc(str(tmp_path)) is True
    (tmp_path / "1" / "environ").write_text("PATH=/bin\0")
    assert gv.inside_lxc(str(tmp_path)) is False
    (tmp_path / "self" / "cgroup").write_text("0::/lxc/200/ns\n")  # no cgroup namespace
    assert gv.inside_lxc(str(tmp_path)) is True


def test_idle_and_busy_by_memory_and_processes():
    gpus, processes = snapshot(H100_BUSY, H100_APPS)
    assert gv.unmet("busy", gpus, processes, [0], 100, None) == []
    assert gv.unmet("idle", gpus, processes, [1], 100, None) == []
    reasons = gv.unmet("idle", gpus, processes, None, 100, None)
    assert reasons == ["GPU 0 is busy: 1 compute process(es) [81234], 61234 MiB used > 100"]
    assert gv.unmet("busy", gpus, processes, None, 100, None) == [
        "GPU 1 is idle: no compute process, 4 MiB used <= 100"]


def test_memory_alone_makes_a_gpu_busy_since_container_pids_may_be_hidden():
    gpus, processes = snapshot(H100_BUSY)  # inside LXC the process list can come back empty
    assert gv.unmet("busy", gpus, processes, [0], 100, None) == []
    assert gv.unmet("idle", gpus, processes, [0], 70000, None) == []  # threshold raised


def test_unknown_memory_is_judged_by_processes():
    gpus, processes = snapshot(PLACEHOLDER_ROWS)
    assert gv.unmet("idle", gpus, processes, [2, 3], 100, None) == []
    busy = "2, GPU-cccccccc-0000-0000-0000-000000000000, [N/A]\n"
    gpus, processes = snapshot(PLACEHOLDER_ROWS, busy)
    assert gv.unmet("busy", gpus, processes, [2], 100, None) == []


def test_present_count_and_missing_gpus():
    gpus, processes = snapshot(H100_IDLE)
    assert gv.unmet("present", gpus, processes, None, 100, 2) == []
    assert gv.unmet("present", gpus, processes, None, 100, 8) == ["2 GPU(s) listed, at least 8 required"]
    assert gv.unmet("any", gpus, processes, [0, 5], 100, None) == ["GPU(s) [5] not listed (listed: [0, 1])"]
    assert gv.unmet("present", [], [], None, 100, None) == ["no GPU listed"]
    assert gv.unmet("idle", [], [], None, 100, None) == ["no GPU listed"]
    assert gv.unmet("any", [], [], None, 100, None) == []


def test_table_shows_what_was_seen():
    gpus, processes = snapshot(PLACEHOLDER_ROWS, "2, GPU-cccccccc-0000-0000-0000-000000000000, [N/A]\n")
    processes[0]["vmid"] = 201
    table = gv.render_table(gpus, processes, 100)
    assert table[0].split()[:2] == ["GPU", "MEM"]
    assert table[1].split() == ["0", "13/40960", "?", "0", "idle", "NVIDIA", "A100-SXM4-40GB"]
    assert table[3].split()[:5] == ["2", "?/23028", "0", "1", "busy"]
    assert table[-1].split() == ["2", "2", "?", "201", "?"]
    assert gv.render_table([], [], 100)[1].strip() == "(no GPU listed)"
