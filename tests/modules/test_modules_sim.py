"""training_run and gpu_verify through Ansible against pvesim: a run in CT 200 (on pve1), its GPU
seen from inside the container and from the node, and the stop cases of the seeds.

Each test names its own run and uses GPU 3, which the other tests of the session leave alone.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import yaml
from module_runner import MODULES, REPO, ansible_module, playbook_results

pytestmark = [pytest.mark.sim, pytest.mark.slow]

FAKE_RUN = str(Path(__file__).parent / "fixtures" / "fake_run.py")
VMID = 200
GPU = 3
# The containers' root is an overlay of this machine's, so the repository and its venv are visible
# inside at the same paths.
VENV_PYTHON = sys.executable


class Container:
    """CT 200 of the session sim: Ansible tasks in it, shell commands through `pct exec`."""

    def __init__(self, sim):
        self.sim = sim
        self.node = next(n.name for n in sim.nodes if VMID in n.containers)
        self.tag = f"modtest-{uuid.uuid4().hex[:8]}"
        self.pids_to_kill = []

    def module(self, module_name, host=None, **args):
        result = ansible_module(module_name, args, host=host or f"ct{VMID}",
                                inventory=str(self.sim.inventory_path))
        assert "Traceback" not in json.dumps(result), result
        return result

    def on_node(self, task):
        """Run one task for the container, delegated to its node, through a playbook."""
        task = {(key if "." in key else f"dflash.ops.{key}"): value for key, value in task.items()}
        task = dict(task, name="Read the node's view.", delegate_to=self.node)
        playbook = Path(tempfile.mkdtemp(prefix=f"{self.tag}-")) / "node.yml"
        playbook.write_text(yaml.safe_dump([{"hosts": f"ct{VMID}", "gather_facts": False, "tasks": [task]}]))
        try:
            [result] = playbook_results(playbook, str(self.sim.inventory_path), f"ct{VMID}")
        finally:
            shutil.rmtree(playbook.parent)
        return result

    def run(self, **args):
        return self.module("training_run", name=self.tag, **args)

    def shell(self, script):
        """`ssh node "pct exec 200 -- bash -lc '<script>'"`, as the seeds did it."""
        command = f"pct exec {VMID} -- bash -lc {shlex.quote(script)}"
        return self.sim.ssh(self.node, command, timeout=120)

    def read(self, path):
        done = self.shell(f"for i in $(seq 50); do test -s {path} && break; sleep 0.1; done; cat {path}")
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def alive(self, pid):
        """Alive and not a zombie, inside the container's PID namespace."""
        done = self.shell(f"cat /proc/{pid}/stat 2>/dev/null || true")
        text = done.stdout
        return bool(text) and text[text.rfind(")") + 2] not in "ZX"

    def start_decoy(self):
        """A process whose command line contains the run's script name, as `pkill -f` would match."""
        pidfile = f"/tmp/{self.tag}-decoy.pid"
        script = (f"setsid -f sh -c 'echo $$ > {pidfile}; exec python3 -c \"import time; time.sleep(600)\""
                  f" {FAKE_RUN}' < /dev/null > /dev/null 2>&1")
        assert self.shell(script).returncode == 0
        pid = int(self.read(pidfile))
        self.pids_to_kill.append(pid)
        return pid

    def cleanup(self):
        self.shell(training_run_command(name=self.tag, state="stopped", stop_timeout=1, kill_timeout=5))
        for pid in self.pids_to_kill:
            self.shell(f"kill -KILL {pid} 2>/dev/null || true")


def training_run_command(**args):
    """A shell command running training_run in the container without Ansible (arguments as JSON)."""
    payload = shlex.quote(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    return f"PYTHONPATH={REPO} {VENV_PYTHON} {MODULES}/training_run.py {payload}"


@pytest.fixture
def ct(sim):
    container = Container(sim)
    yield container
    container.cleanup()


def test_run_lifecycle_gpus_and_the_pkill_trap(ct):
    decoy = ct.start_decoy()
    env = {"CUDA_VISIBLE_DEVICES": str(GPU), "PVESIM_GPU_MEMORY_MIB": "2048"}
    started = ct.run(command=["/usr/bin/python3", FAKE_RUN], environment=env)
    assert started.get("changed") is True, started
    pid = started["pid"]
    assert started["run"]["pgid"] == pid and started["run"]["argv"][1] == FAKE_RUN

    status = ct.run(state="status")
    assert status["status"] == "running" and status["pid"] == pid and status["changed"] is False

    # Inside the container: judged by memory and process count (the pids are the host's).
    busy = ct.module("gpu_verify", expect="busy", gpus=[GPU], timeout=20, interval=0.5)
    assert busy.get("failed") is not True, busy
    on_gpu = [p for p in busy["processes"] if p["gpu_index"] == GPU]
    assert len(on_gpu) == 1 and on_gpu[0]["used_memory_mib"] == 2048 and on_gpu[0]["vmid"] is None

    # On the node (delegate_to, as a role does it): the same process, mapped to its container
    # through its cgroup.
    node = ct.on_node(dict(gpu_verify=dict(expect="busy", gpus=[GPU])))
    assert node.get("failed") is not True, node
    ours = [p for p in node["processes"] if p["container_pid"] == pid]
    assert [(p["vmid"], p["gpu_index"], p["pid"]) for p in ours] == [(VMID, GPU, on_gpu[0]["pid"])]

    # The seeds' chain: ssh node "pct exec 200 -- bash -lc '...<script name>...'". The shell that
    # runs the stop carries the script's name in its command line and must live to say so.
    survived = f"shell survived {Path(FAKE_RUN).name}"
    stop = ct.shell(f"{training_run_command(name=ct.tag, state='stopped')}; echo {survived}")
    assert stop.returncode == 0, (stop.returncode, stop.stdout, stop.stderr)
    assert stop.stdout.strip().endswith(survived)
    result = json.loads(stop.stdout.strip().splitlines()[0])
    assert result["how"] == "terminated" and result["signalled"] == [pid]
    assert not ct.alive(pid)
    assert ct.alive(decoy)

    idle = ct.module("gpu_verify", expect="idle", gpus=[GPU], timeout=20, interval=0.5)
    assert idle.get("failed") is not True, idle
    assert ct.run(state="status")["status"] == "stopped"


def test_pidfile_naming_an_unrelated_process_is_stale_and_it_survives(ct):
    decoy = ct.start_decoy()
    stat = ct.read(f"/proc/{decoy}/stat")
    start_time = int(stat[stat.rfind(")") + 2 :].split()[19])
    # The pidfile of an earlier run whose pid now belongs to the decoy (another start time).
    record = json.dumps({"pid": decoy, "pgid": decoy, "start_time": start_time - 1, "argv": [FAKE_RUN]})
    pidfile = f"/var/lib/dflash/{ct.tag}.pid"
    written = ct.shell(f"mkdir -p /var/lib/dflash && echo {shlex.quote(record)} > {pidfile}")
    assert written.returncode == 0
    result = ct.run(state="stopped", stop_timeout=1)
    assert result.get("failed") is not True, result
    assert result["how"] == "stale_pidfile" and result["signalled"] == [] and "reused" in result["msg"]
    assert ct.alive(decoy)


def test_stubborn_run_is_killed_and_its_escaped_child_stopped(ct):
    escaped_file = f"/tmp/{ct.tag}-escaped"
    started = ct.run(command=["/usr/bin/python3", FAKE_RUN, "--ignore-term", "--escaped-child", escaped_file])
    assert started.get("changed") is True, started
    pid, escaped = started["pid"], int(ct.read(escaped_file))
    ct.pids_to_kill.append(escaped)
    group = ct.shell(f"ps -o pgid= -p {escaped}").stdout.strip()
    assert group and int(group) != pid  # it left the run's process group

    result = ct.run(state="stopped", stop_timeout=2, kill_timeout=5)
    assert result.get("failed") is not True, result
    assert result["how"] == "killed" and result["seconds"] >= 2
    assert set(result["signalled"]) == {pid, escaped}
    assert not ct.alive(pid) and not ct.alive(escaped)


def test_pct_container_check_delegated_to_the_node(ct):
    """The node checks as the playbooks run them: for the container's host, delegated to its node,
    against pvesim's pct (its list and config formats) and the container's nvidia-smi."""
    args = dict(node_name=ct.node, require_gpu_passthrough=True, required_gpus=[0, 3])
    ok = ct.on_node(dict(pct_container_check=dict(vmid=VMID, **args)))
    assert ok.get("failed") is not True, ok
    assert ok["status"] == "running" and ok["gpu_count"] == 4 and ok["changed"] is False
    assert ok["gpu_devices"] == [f"/dev/nvidia{i}" for i in range(4)] + [
        "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    beyond = ct.on_node(dict(pct_container_check=dict(vmid=VMID, **dict(args, required_gpus=[8]))))
    assert beyond.get("failed") and "has 4 GPU(s)" in beyond["msg"] and "names GPU(s) [8]" in beyond["msg"]
    missing = ct.on_node(dict(pct_container_check=dict(vmid=299, **args)))
    assert missing.get("failed") and missing["msg"].startswith(f"CT 299 does not exist on node {ct.node}")
    assert missing["msg"].endswith("the node has 200, 201.") and missing["containers"] == [200, 201]
