"""The simulated nvidia-smi against a fake /proc: formats exactly as the real tool prints them."""

import io
import json

import pytest
from simtools import load_script

smi = load_script("nvidia-smi")

GPUS = [{"index": i, "uuid": f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd", "name": "NVIDIA H200",
         "memory_total": 143771} for i in range(3)]


def fake_process(proc, pid, state="S", env=None, cgroup="/pvesim-t/lxc/200/ns", comm="python3"):
    d = proc / str(pid)
    d.mkdir()
    (d / "stat").write_text(f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 "
                            f"{1000 + pid} 0 0\n")
    (d / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in (env or {}).items()))
    (d / "cgroup").write_text(f"0::{cgroup}\n")


@pytest.fixture
def config(tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    fake_process(proc, 4242, env={"CUDA_VISIBLE_DEVICES": "0,2", "PVESIM_GPU_MEMORY_MIB": "2048"})
    fake_process(proc, 4300, env={"CUDA_VISIBLE_DEVICES": "1"})
    fake_process(proc, 4301, state="Z", env={"CUDA_VISIBLE_DEVICES": "1"})  # a zombie holds nothing
    fake_process(proc, 4302, env={"PATH": "/usr/bin"})  # no CUDA_VISIBLE_DEVICES: no GPU
    fake_process(proc, 4303, env={"CUDA_VISIBLE_DEVICES": "2"}, cgroup="/pvesim-t/lxc/201/ns")  # other CT
    return {"proc": str(proc), "gpus": GPUS, "cgroups": ["/pvesim-t/lxc/200"]}


def run(config, *argv):
    out = io.StringIO()
    rc = smi.run(list(argv), config, out)
    return rc, out.getvalue()


def test_query_gpu_csv_has_units_and_header(config):
    fields = "index,uuid,name,memory.used,memory.total,utilization.gpu"
    rc, out = run(config, f"--query-gpu={fields}", "--format=csv")
    assert rc == 0
    assert out.splitlines() == [
        "index, uuid, name, memory.used [MiB], memory.total [MiB], utilization.gpu [%]",
        f"0, {GPUS[0]['uuid']}, NVIDIA H200, 2048 MiB, 143771 MiB, 100 %",
        f"1, {GPUS[1]['uuid']}, NVIDIA H200, 1024 MiB, 143771 MiB, 100 %",
        f"2, {GPUS[2]['uuid']}, NVIDIA H200, 2048 MiB, 143771 MiB, 100 %",
    ]


def test_noheader_and_nounits(config):
    rc, out = run(config, "--query-gpu=index,memory.used,utilization.gpu", "--format=csv,noheader")
    assert (rc, out) == (0, "0, 2048 MiB, 100 %\n1, 1024 MiB, 100 %\n2, 2048 MiB, 100 %\n")
    rc, out = run(config, "--query-gpu=index,memory.used,utilization.gpu", "--format=csv,noheader,nounits")
    assert (rc, out) == (0, "0, 2048, 100\n1, 1024, 100\n2, 2048, 100\n")


def test_compute_apps_list_live_holders_of_this_container_only(config):
    rc, out = run(config, "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv")
    assert rc == 0
    assert out.splitlines() == [
        "pid, gpu_uuid, used_gpu_memory [MiB]",
        f"4242, {GPUS[0]['uuid']}, 2048 MiB",
        f"4300, {GPUS[1]['uuid']}, 1024 MiB",
        f"4242, {GPUS[2]['uuid']}, 2048 MiB",
    ]


def test_no_compute_apps_gives_header_only_or_nothing(config, tmp_path):
    empty = dict(config, cgroups=["/pvesim-t/lxc/999"])
    assert run(empty, "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv") == \
        (0, "pid, gpu_uuid, used_gpu_memory [MiB]\n")
    assert run(empty, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits") == (0, "")
    rc, out = run(empty, "--query-gpu=index,memory.used,utilization.gpu", "--format=csv,noheader,nounits")
    assert out == "0, 0, 0\n1, 0, 0\n2, 0, 0\n"


def test_list_gpus(config):
    rc, out = run(config, "-L")
    assert rc == 0
    assert out.splitlines()[1] == f"GPU 1: NVIDIA H200 (UUID: {GPUS[1]['uuid']})"
    assert len(out.splitlines()) == 3


def test_cuda_visible_devices_by_uuid_and_stops_at_an_invalid_entry():
    assert smi.visible_gpus("GPU-00000002,0", GPUS) == [GPUS[2], GPUS[0]]
    assert smi.visible_gpus("1,7,0", GPUS) == [GPUS[1]]
    assert smi.visible_gpus("", GPUS) == []


def test_no_devices(config):
    assert run(dict(config, gpus=[]), "-L") == (6, "No devices were found\n")
    assert run(dict(config, gpus=[]), "--query-gpu=index", "--format=csv")[0] == 6


def test_bad_field_and_missing_format(config):
    rc, out = run(config, "--query-gpu=index,bogus", "--format=csv")
    assert rc == 2 and 'Field "bogus" is not a valid field to query.' in out
    rc, out = run(config, "--query-gpu=index")
    assert rc == 2 and "--format" in out


def test_missing_config_means_no_devices(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PVESIM_NVIDIA_SMI_CONFIG", str(tmp_path / "absent.json"))
    monkeypatch.setattr("sys.argv", ["nvidia-smi", "-L"])
    assert smi.main() == 6
    assert capsys.readouterr().out == "No devices were found\n"
    (tmp_path / "present.json").write_text(json.dumps({"proc": str(tmp_path), "gpus": GPUS, "cgroups": []}))
    monkeypatch.setenv("PVESIM_NVIDIA_SMI_CONFIG", str(tmp_path / "present.json"))
    assert smi.main() == 0
