"""Unit tests of gpu_verify's pure helpers on nvidia-smi output as real machines print it."""

from __future__ import annotations

import pytest

from ansible_collections.dflash.ops.plugins.modules import gpu_verify as gv

# `--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu --format=csv,noheader,nounits`
H100_IDLE = """\
0, GPU-9f1d7c2a-4c0b-7a5e-3b1f-2d8e6a4c9b10, NVIDIA H100 80GB HBM3, 0, 81559, 0
1, GPU-1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901, NVIDIA H100 80GB HBM3, 4, 81559, 0
"""
# A training run on GPU 0; GPU 1 has a little memory used by the driver only.
H100_BUSY = """\
0, GPU-9f1d7c2a-4c0b-7a5e-3b1f-2d8e6a4c9b10, NVIDIA H100 80GB HBM3, 61234, 81559, 97
1, GPU-1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901, NVIDIA H100 80GB HBM3, 4, 81559, 0
"""
H100_APPS = """\
81234, GPU-9f1d7c2a-4c0b-7a5e-3b1f-2d8e6a4c9b10, 61220
"""
# MIG mode: utilization is not reported; a consumer card: no utilization either; a container
# without the right device permissions; a GPU in trouble.
PLACEHOLDER_ROWS = """\
0, GPU-aaaaaaaa-0000-0000-0000-000000000000, NVIDIA A100-SXM4-40GB, 13, 40960, [N/A]
1, GPU-bbbbbbbb-0000-0000-0000-000000000000, NVIDIA GeForce GTX 1080, 305, 8192, [Not Supported]
2, GPU-cccccccc-0000-0000-0000-000000000000, NVIDIA A10, [Insufficient Permissions], 23028, 0
3, GPU-dddddddd-0000-0000-0000-000000000000, NVIDIA A10, [Unknown Error], [Unknown Error], [Unknown Error]
4, GPU-eeeeeeee-0000-0000-0000-000000000000, NVIDIA A10, N/A, 23028, [GPU requires reset]
"""


def test_parse_gpus_of_an_idle_node():
    gpus = gv.parse_gpus(H100_IDLE)
    assert gpus == [
        {"index": 0, "uuid": "GPU-9f1d7c2a-4c0b-7a5e-3b1f-2d8e6a4c9b10", "name": "NVIDIA H100 80GB HBM3",
         "memory_used_mib": 0, "memory_total_mib": 81559, "utilization_pct": 0},
        {"index": 1, "uuid": "GPU-1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901", "name": "NVIDIA H100 80GB HBM3",
         "memory_used_mib": 4, "memory_total_mib": 81559, "utilization_pct": 0},
    ]


def test_placeholders_become_none_in_every_field():
    gpus = gv.parse_gpus(PLACEHOLDER_ROWS)
    assert [g["utilization_pct"] for g in gpus] == [None, None, 0, None, None]
    assert [g["memory_used_mib"] for g in gpus] == [13, 305, None, None, None]
    assert gpus[3]["memory_total_mib"] is None
    assert gpus[1]["name"] == "NVIDIA GeForce GTX 1080"


def test_a_name_with_a_comma_is_kept_whole():
    gpus = gv.parse_gpus("0, GPU-x, Some Vendor, Model 9, 100, 200, 5\n")
    assert gpus[0]["name"] == "Some Vendor, Model 9" and gpus[0]["memory_total_mib"] == 200


def test_processes_get_their_gpu_index():
    gpus = gv.parse_gpus(H100_BUSY)
    processes = gv.parse_processes(H100_APPS, gpus)
    assert processes == [{"pid": 81234, "gpu_uuid": "GPU-9f1d7c2a-4c0b-7a5e-3b1f-2d8e6a4c9b10",
                          "gpu_index": 0, "used_memory_mib": 61220, "vmid": None, "container_pid": None}]


def test_process_placeholders_and_the_old_no_process_line():
    gpus = gv.parse_gpus(H100_BUSY)
    output = "No running processes found\n\n81234, GPU-9f1d7c2a-4c0b-7a5e-3b1f-2d8e6a4c9b10, [N/A]\n"
    processes = gv.parse_processes(output, gpus)
    assert len(processes) == 1 and processes[0]["used_memory_mib"] is None
    assert gv.parse_processes("", gpus) == []
    # A MIG instance's uuid names no full GPU: the process stays, without an index.
    mig = gv.parse_processes("7, MIG-1234, 100\n", gpus)
    assert mig[0]["gpu_index"] is None


@pytest.mark.parametrize(
    "output",
    ["0, GPU-x, H100, 10, 20\n", "0, GPU-x, H100, lots, 20, 0\n", "not csv at all\n"],
)
def test_unexpected_gpu_output_is_an_error_naming_the_line(output):
    with pytest.raises(gv.NvidiaSmiError, match="GPU|gave"):
        gv.parse_gpus(output)


def test_unexpected_process_output_is_an_error():
    with pytest.raises(gv.NvidiaSmiError, match="process line"):
        gv.parse_processes("81234, GPU-x\n", [])


# What nvidia-smi prints and returns when it cannot work (see nvidia-smi(1), RETURN VALUE).
DRIVER_NOT_LOADED = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                     "Make sure that the latest NVIDIA driver is installed and running.\n")
VERSION_MISMATCH = "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 535.161"
NVML_UNKNOWN = "Failed to initialize NVML: Unknown Error\n"


@pytest.mark.parametrize(
    "rc, output, expected",
    [
        (9, DRIVER_NOT_LOADED, "cannot reach the NVIDIA driver"),
        (18, VERSION_MISMATCH, "differ in version"),
        (255, NVML_UNKNOWN, "access to the /dev/nvidia* devices was lost"),
        (4, "Failed to initialize NVML: Insufficient Permissions\n", "lacks permission"),
        (12, "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system.", "libnvidia-ml.so"),
        (15, "Unable to determine the device handle for GPU0000:18:00.0: GPU is lost.", "fallen off the bus"),
        (14, "", "infoROM is corrupted"),
        (77, "something new", "unknown exit code"),
    ],
)
def test_failures_are_explained(rc, output, expected):
    message = gv.explain_failure(rc, output)
    assert expected in message and f"exit {rc}" in message


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
    assert gv.vmid_from_cgroup(cgroup) == vmid


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


def snapshot(gpu_output, apps_output=""):
    gpus = gv.parse_gpus(gpu_output)
    return gpus, gv.parse_processes(apps_output, gpus)


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
