"""The simulated nvidia-smi against a fake /proc: formats exactly as the real tool prints them."""

import io
import json

import pytest
from simtools import load_script

smi = load_script("nvidia-smi")

GPUS = [{"index": i, "uuid": f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd", "name": "NVIDIA H200",
         "memory_total": 143771} for i in range(4)]
HOST_PIDNS = "pid:[1]"
CT_PIDNS = {200: "pid:[200]", 201: "pid:[201]"}
NODE_ENV = {"PVESIM_NODE": "pve1", "PVESIM_STATE_DIR": "/sim"}


def fake_process(proc, pid, state="S", env=None, vmid=200, comm="python3"):
    """A process of a container (`vmid`), of the node (vmid None) or of another node (vmid "other")."""
    d = proc / str(pid)
    d.mkdir()
    (d / "stat").write_text(f"{pid} ({comm}) {state} 1 {pid} {pid} 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 "
                            f"{1000 + pid} 0 0\n")
    (d / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in (env or {}).items()))
    inner = f"\t{pid - 4000}" if vmid in CT_PIDNS else ""  # the pid its container sees
    (d / "status").write_text(f"Name:\t{comm}\nNSpid:\t{pid}{inner}\n")
    (d / "ns").mkdir()
    (d / "ns" / "pid").symlink_to(CT_PIDNS.get(vmid, HOST_PIDNS))


def node_state(tmp_path, compute_apps="host", containers=None):
    """The node's GPU state: 4 GPUs, CT 200 given GPUs 0, 1, 2 and CT 201 GPU 3 (by default)."""
    if containers is None:
        containers = {200: [0, 1, 2], 201: [3]}
    state = {"state_dir": "/sim", "node": "pve1", "compute_apps": compute_apps, "host_pidns": HOST_PIDNS,
             "gpus": GPUS, "devices": [],
             "containers": {str(v): {"gpus": g, "ctl": True, "pidns": CT_PIDNS[v]}
                            for v, g in containers.items()}}
    path = tmp_path / f"state-{compute_apps}-{len(containers)}.json"
    path.write_text(json.dumps(state))
    return str(path)


@pytest.fixture
def proc(tmp_path):
    proc = tmp_path / "proc"
    proc.mkdir()
    fake_process(proc, 4242, env={"CUDA_VISIBLE_DEVICES": "0,2", "PVESIM_GPU_MEMORY_MIB": "2048"})
    fake_process(proc, 4300, env={"CUDA_VISIBLE_DEVICES": "1"})
    fake_process(proc, 4301, state="Z", env={"CUDA_VISIBLE_DEVICES": "1"})  # a zombie holds nothing
    fake_process(proc, 4302, env={"PATH": "/usr/bin"})  # no CUDA_VISIBLE_DEVICES: no GPU
    fake_process(proc, 4303, env={"CUDA_VISIBLE_DEVICES": "0"}, vmid=201)  # CT 201's GPU 0: node GPU 3
    fake_process(proc, 4304, env={"CUDA_VISIBLE_DEVICES": "1", **NODE_ENV, "PVESIM_NODE": "pve2"},
                 vmid=None)  # another node's process: not on this node's GPUs
    return proc


def run(config, *argv):
    out = io.StringIO()
    rc = smi.run(list(argv), config, out)
    return rc, out.getvalue()


@pytest.fixture
def config(tmp_path, proc):
    """nvidia-smi in CT 200."""
    return {"state": node_state(tmp_path), "proc": str(proc), "vmid": 200}


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


def test_no_compute_apps_gives_header_only_or_nothing(tmp_path, proc):
    empty = {"state": node_state(tmp_path, containers={200: [0, 1, 2], 201: []}), "proc": str(proc),
             "vmid": 201}
    rc, out = run(empty, "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv")
    assert (rc, out) == (6, "No devices were found\n")  # CT 201 given no GPU
    idle = {"state": node_state(tmp_path, containers={200: [0, 1, 2], 201: [3]}), "proc": str(tmp_path),
            "vmid": 201}
    assert run(idle, "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv") == \
        (0, "pid, gpu_uuid, used_gpu_memory [MiB]\n")
    assert run(idle, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits") == (0, "")
    rc, out = run(idle, "--query-gpu=index,memory.used,utilization.gpu", "--format=csv,noheader,nounits")
    assert out == "0, 0, 0\n"


def test_list_gpus(config):
    rc, out = run(config, "-L")
    assert rc == 0
    assert out.splitlines()[1] == f"GPU 1: NVIDIA H200 (UUID: {GPUS[1]['uuid']})"
    assert len(out.splitlines()) == 3


def test_a_container_sees_its_gpus_numbered_from_0_with_their_physical_uuids(tmp_path, proc):
    ct201 = {"state": node_state(tmp_path), "proc": str(proc), "vmid": 201}
    assert run(ct201, "-L") == (0, f"GPU 0: NVIDIA H200 (UUID: {GPUS[3]['uuid']})\n")
    rc, out = run(ct201, "--query-gpu=index,pci.bus_id,memory.used", "--format=csv,noheader,nounits")
    assert out == "0, 00000000:1B:00.0, 1024\n"  # the bus id is the physical GPU's


@pytest.mark.parametrize("compute_apps", ["host", "container"])
def test_memory_and_utilization_are_per_device_whichever_container_uses_it(tmp_path, proc, compute_apps):
    # CT 200 and CT 201 share node GPU 2; CT 201 runs a process on it (its GPU 1).
    state = node_state(tmp_path, compute_apps, containers={200: [0, 1, 2], 201: [2, 3]})
    fake_process(proc, 4400, env={"CUDA_VISIBLE_DEVICES": "0", "PVESIM_GPU_MEMORY_MIB": "500"}, vmid=201)
    ct200 = {"state": state, "proc": str(proc), "vmid": 200}
    rc, out = run(ct200, "--query-gpu=index,memory.used,utilization.gpu", "--format=csv,noheader,nounits")
    assert out.splitlines()[2] == "2, 3572, 100"  # CT 200's 2048 MiB, CT 201's 1024 and 500 MiB
    rc, apps = run(ct200, "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits")
    if compute_apps == "host":  # every process on the device, host PIDs
        assert apps.splitlines() == [f"4242, {GPUS[0]['uuid']}, 2048", f"4300, {GPUS[1]['uuid']}, 1024",
                                     f"4242, {GPUS[2]['uuid']}, 2048", f"4303, {GPUS[2]['uuid']}, 1024",
                                     f"4400, {GPUS[2]['uuid']}, 500"]
    else:  # only CT 200's own processes, with the PIDs CT 200 sees
        assert apps.splitlines() == [f"242, {GPUS[0]['uuid']}, 2048", f"300, {GPUS[1]['uuid']}, 1024",
                                     f"242, {GPUS[2]['uuid']}, 2048"]
    node = {"state": state, "proc": str(proc)}  # on the node: every GPU, every process, host PIDs
    rc, out = run(node, "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader,nounits")
    assert [line.split(",")[0] for line in out.splitlines()] == ["4242", "4300", "4242", "4303", "4400"]


def test_a_node_process_holds_the_node_s_gpus(tmp_path, proc):
    fake_process(proc, 4500, env={"CUDA_VISIBLE_DEVICES": "3", **NODE_ENV}, vmid=None)
    node = {"state": node_state(tmp_path), "proc": str(proc)}
    rc, out = run(node, "--query-gpu=index,memory.used", "--format=csv,noheader,nounits")
    assert out.splitlines()[3] == "3, 2048"  # CT 201's process and the node's, both on node GPU 3


def test_a_container_without_nvidiactl_cannot_reach_the_driver(tmp_path, proc):
    state = json.loads(open(node_state(tmp_path)).read())
    state["containers"]["200"]["ctl"] = False
    (tmp_path / "noctl.json").write_text(json.dumps(state))
    rc, out = run({"state": str(tmp_path / "noctl.json"), "proc": str(proc), "vmid": 200}, "-L")
    assert rc == 9 and "couldn't communicate with the NVIDIA driver" in out


def test_cuda_visible_devices_by_uuid_and_stops_at_an_invalid_entry():
    assert smi.visible_gpus("GPU-00000002,0", GPUS) == [GPUS[2], GPUS[0]]
    assert smi.visible_gpus("1,7,0", GPUS) == [GPUS[1]]
    assert smi.visible_gpus("", GPUS) == []


def test_no_devices(tmp_path, proc):
    bare = {"state": node_state(tmp_path, containers={200: []}), "proc": str(proc), "vmid": 200}
    assert run(bare, "-L") == (6, "No devices were found\n")
    assert run(bare, "--query-gpu=index", "--format=csv")[0] == 6


def test_bad_field_and_missing_format(config):
    rc, out = run(config, "--query-gpu=index,bogus", "--format=csv")
    assert rc == 2 and 'Field "bogus" is not a valid field to query.' in out
    rc, out = run(config, "--query-gpu=index")
    assert rc == 2 and "--format" in out


def test_missing_config_means_no_driver(tmp_path, monkeypatch, capsys, proc):
    monkeypatch.setenv("PVESIM_NVIDIA_SMI_CONFIG", str(tmp_path / "absent.json"))
    monkeypatch.setattr("sys.argv", ["nvidia-smi", "-L"])
    assert smi.main() == 9
    assert "couldn't communicate with the NVIDIA driver" in capsys.readouterr().out
    (tmp_path / "present.json").write_text(json.dumps({"state": node_state(tmp_path), "proc": str(proc)}))
    monkeypatch.setenv("PVESIM_NVIDIA_SMI_CONFIG", str(tmp_path / "present.json"))
    assert smi.main() == 0
