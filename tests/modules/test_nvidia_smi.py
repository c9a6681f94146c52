"""Unit tests of module_utils/nvidia_smi: the collection's queries, the reading of nvidia-smi's answers
as real machines print them, and what its failures mean."""

from __future__ import annotations

import importlib
import re
import shlex

import pytest
import yaml

from ansible_collections.dflash.ops.plugins.module_utils import nvidia_smi as smi

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
# `--query-gpu=index,uuid,minor_number,driver_version`: the node's GPU 1 is /dev/nvidia3 (minor numbers
# follow the driver's probe order, not the index); a GPU without a device node gives no minor number.
NODE_DEVICES = """\
0, GPU-aaaa, 2, 550.127.05
1, GPU-bbbb, 3, 550.127.05
2, GPU-cccc, [N/A], 550.127.05
"""

# What nvidia-smi prints and returns when it cannot work (see nvidia-smi(1), RETURN VALUE).
DRIVER_NOT_LOADED = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                     "Make sure that the latest NVIDIA driver is installed and running.\n")
VERSION_MISMATCH = "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 535.161"
NVML_UNKNOWN = "Failed to initialize NVML: Unknown Error\n"


@pytest.mark.parametrize("query, option", [
    (smi.GPU_LOAD, "--query-gpu=index,uuid,name,memory.used,memory.total,utilization.gpu"),
    (smi.GPU_IDS, "--query-gpu=index,uuid"),
    (smi.GPU_DEVICES, "--query-gpu=index,uuid,minor_number,driver_version"),
    (smi.COMPUTE_APPS, "--query-compute-apps=pid,gpu_uuid,used_memory"),
])
def test_each_query_asks_nvidia_smi_for_its_fields_as_bare_csv(query, option):
    assert query.argv == [option, "--format=csv,noheader,nounits"]


def test_parse_gpus_of_an_idle_node():
    assert smi.GPU_LOAD.parse(H100_IDLE) == [
        {"index": 0, "uuid": "GPU-9f1d7c2a-4c0b-7a5e-3b1f-2d8e6a4c9b10", "name": "NVIDIA H100 80GB HBM3",
         "memory_used_mib": 0, "memory_total_mib": 81559, "utilization_pct": 0},
        {"index": 1, "uuid": "GPU-1b2c3d4e-5f60-7182-93a4-b5c6d7e8f901", "name": "NVIDIA H100 80GB HBM3",
         "memory_used_mib": 4, "memory_total_mib": 81559, "utilization_pct": 0},
    ]


def test_placeholders_become_none_in_every_field():
    gpus = smi.GPU_LOAD.parse(PLACEHOLDER_ROWS)
    assert [g["utilization_pct"] for g in gpus] == [None, None, 0, None, None]
    assert [g["memory_used_mib"] for g in gpus] == [13, 305, None, None, None]
    assert gpus[3]["memory_total_mib"] is None
    assert gpus[1]["name"] == "NVIDIA GeForce GTX 1080"
    assert smi.GPU_IDS.parse("0, [N/A]\n") == [{"index": 0, "uuid": None}]


def test_a_name_with_a_comma_is_kept_whole():
    gpus = smi.GPU_LOAD.parse("0, GPU-x, Some Vendor, Model 9, 100, 200, 5\n")
    assert gpus[0]["name"] == "Some Vendor, Model 9" and gpus[0]["memory_total_mib"] == 200


def test_node_devices_give_minor_numbers_and_the_driver():
    devices = smi.GPU_DEVICES.parse(NODE_DEVICES)
    assert [(d["index"], d["minor"]) for d in devices] == [(0, 2), (1, 3), (2, None)]
    assert {d["driver"] for d in devices} == {"550.127.05"} and devices[1]["uuid"] == "GPU-bbbb"


def test_processes_and_the_lines_nvidia_smi_prints_in_place_of_rows():
    assert smi.COMPUTE_APPS.parse(H100_APPS) == [
        {"pid": 81234, "gpu_uuid": "GPU-9f1d7c2a-4c0b-7a5e-3b1f-2d8e6a4c9b10", "used_memory_mib": 61220}]
    older_driver = "No running processes found\n\n81234, GPU-x, [N/A]\n"
    assert smi.COMPUTE_APPS.parse(older_driver) == [
        {"pid": 81234, "gpu_uuid": "GPU-x", "used_memory_mib": None}]
    assert smi.COMPUTE_APPS.parse("") == []
    assert smi.GPU_IDS.parse("No devices were found\n") == []


@pytest.mark.parametrize("query, output, message", [
    (smi.GPU_LOAD, "0, GPU-x, H100, 10, 20\n", "unexpected nvidia-smi GPU line (want 6 fields): "
                                               "'0, GPU-x, H100, 10, 20'"),
    (smi.GPU_LOAD, "0, GPU-x, H100, lots, 20, 0\n", "nvidia-smi gave 'lots' for memory.used in line "
                                                    "'0, GPU-x, H100, lots, 20, 0'"),
    (smi.GPU_LOAD, "not csv at all\n", "unexpected nvidia-smi GPU line (want 6 fields): 'not csv at all'"),
    # Only the free-text name absorbs commas: a query without one wants its fields exactly.
    (smi.GPU_IDS, "0\n", "unexpected nvidia-smi GPU line (want 2 fields): '0'"),
    (smi.GPU_IDS, "0, GPU-a, extra\n", "unexpected nvidia-smi GPU line (want 2 fields): '0, GPU-a, extra'"),
    (smi.COMPUTE_APPS, "81234, GPU-x\n",
     "unexpected nvidia-smi process line (want 3 fields): '81234, GPU-x'"),
    (smi.COMPUTE_APPS, "x1, GPU-x, 5\n", "nvidia-smi gave 'x1' for pid in line 'x1, GPU-x, 5'"),
])
def test_unexpected_output_is_an_error_naming_the_line(query, output, message):
    with pytest.raises(smi.NvidiaSmiError) as raised:
        query.parse(output)
    assert str(raised.value) == message


@pytest.mark.parametrize(
    "rc, output, expected",
    [
        (9, DRIVER_NOT_LOADED, "cannot reach the NVIDIA driver"),
        (18, VERSION_MISMATCH, "reinstall the containers' user space of the node's version with "
                               "ansible-playbook playbooks/provision.yml"),
        (255, NVML_UNKNOWN, "access to the /dev/nvidia* devices was lost"),
        (4, "Failed to initialize NVML: Insufficient Permissions\n", "lacks permission"),
        (12, "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system.", "libnvidia-ml.so"),
        (15, "Unable to determine the device handle for GPU0000:18:00.0: GPU is lost.", "fallen off the bus"),
        (14, "", "infoROM is corrupted"),
        (77, "something new", "unknown exit code"),
    ],
)
def test_failures_are_explained(rc, output, expected):
    message = smi.explain_failure(rc, output)
    assert expected in message and f"exit {rc}" in message


def test_a_known_failure_keeps_nvidia_smi_s_words_on_one_line():
    assert smi.explain_failure(18, VERSION_MISMATCH).endswith(
        "(nvidia-smi exit 18: Failed to initialize NVML: Driver/library version mismatch NVML library "
        "version: 535.161)")
    assert smi.explain_failure(3, "") == ("nvidia-smi failed with exit 3 (the requested operation is not "
                                          "available on the target device): no output")


@pytest.mark.parametrize("rc, missing", [(None, True), (126, True), (127, True), (0, False), (9, False),
                                         (255, False)])
def test_cannot_run_is_a_program_that_never_ran(rc, missing):
    assert smi.cannot_run(rc) is missing


def test_no_device_is_told_from_a_failure():
    assert smi.lists_no_device("No devices were found")
    assert not smi.lists_no_device(DRIVER_NOT_LOADED)


def test_find_executable(tmp_path, monkeypatch):
    program = tmp_path / "nvidia-smi"
    program.write_text("#!/bin/sh\n")
    assert smi.find_executable(str(program)) is None  # not executable
    program.chmod(0o755)
    assert smi.find_executable(str(program)) == str(program)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert smi.find_executable() == str(program)
    assert smi.find_executable("nvidia-smi-not-installed") is None


def program(tmp_path, script):
    path = tmp_path / "nvidia-smi"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return str(path)


def test_read_runs_the_query_in_the_c_locale(tmp_path):
    # The stand-in answers only the exact arguments of the query, and only in the C locale.
    executable = program(tmp_path, '[ "$LC_ALL" = C ] && [ "$*" = "--query-gpu=index,uuid '
                                   '--format=csv,noheader,nounits" ] && echo "0, GPU-a" || exit 2')
    assert smi.GPU_IDS.read(executable) == [{"index": 0, "uuid": "GPU-a"}]


@pytest.mark.parametrize("script, message", [
    ('echo "No devices were found"; exit 6', None),
    (f"printf %s {shlex.quote(DRIVER_NOT_LOADED)}; exit 9", "nvidia-smi cannot reach the NVIDIA driver"),
    ("echo oops", "unexpected nvidia-smi GPU line (want 2 fields): 'oops'"),
    ("exec sleep 5", "nvidia-smi did not answer within 0.5s (--query-gpu=index,uuid)"),
])
def test_read_lists_no_device_or_says_why_it_cannot(tmp_path, script, message):
    executable = program(tmp_path, script)
    if message is None:
        assert smi.GPU_IDS.read(executable) == []
        return
    with pytest.raises(smi.NvidiaSmiError) as raised:
        smi.GPU_IDS.read(executable, timeout=0.5)
    assert str(raised.value).startswith(message)


def test_read_of_a_program_that_cannot_start(tmp_path):
    with pytest.raises(smi.NvidiaSmiError, match="^cannot run .*: No such file or directory$"):
        smi.COMPUTE_APPS.read(str(tmp_path / "absent"))


@pytest.mark.parametrize("module, queries", [
    ("gpu_verify", (smi.GPU_LOAD, smi.COMPUTE_APPS)),
    ("pct_container_check", (smi.GPU_IDS,)),
])
def test_the_modules_documentation_names_the_queries_they_run(module, queries):
    """DOCUMENTATION is a literal (ansible-doc reads it without importing the module), so it cannot be
    built from the queries: this keeps the two the same when a field is added."""
    doc = yaml.safe_load(importlib.import_module(f"ansible_collections.dflash.ops.plugins.modules.{module}")
                         .DOCUMENTATION)
    text = " ".join(doc["description"])
    named = set(re.findall(r"--query-[a-z-]+=[a-z._,]+", text))
    assert named == {query.argv[0] for query in queries}
