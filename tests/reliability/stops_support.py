"""Helpers of the stop tests (decoys, stale pidfiles, stubborn runs, concurrent restarts): one fleet
they share, a container's process table as data, detached processes started and ended by pid, and
training_run run in a container without Ansible.

Everything that runs in a container is a short standard-library program passed to the container's
python3 (`python3 -c`), so a test reads one JSON answer per `pct exec`.
"""

import json
import os
import random
import shlex
import sys
from dataclasses import dataclass

import pytest

from pvesim.fleet import REPO

CONTAINERS = (200, 201, 202, 203)
MODULES = REPO / "ansible_collections" / "dflash" / "ops" / "plugins" / "modules"
FAKE_RUN = str(REPO / "tests" / "modules" / "fixtures" / "fake_run.py")
# The containers' root is an overlay of this machine's: this venv's python is visible inside.
VENV_PYTHON = sys.executable
PIDFILE = "/var/lib/dflash/main.pid"
LOG = "/var/log/dflash/main.log"
RUN_GPUS = (0, 1)  # the sim group_vars' CUDA_VISIBLE_DEVICES
SLEEPER = "import time; time.sleep(3600)"

# ---------------------------------------------------------------------------------------------
# Programs run by the container's python3

# The start of programs that list the container's processes: proc_entries() yields (pid, the stat
# fields after the command name, argv) for every process still there when read.
PROC_ENTRIES = r"""
import os
def proc_entries():
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
        except OSError:
            continue
        yield int(entry), stat[stat.rfind(")") + 2:].split(), argv
"""

PROCESS_TABLE = PROC_ENTRIES + r"""
import json
table = []
for pid, f, argv in proc_entries():
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            env = fh.read().split(b"\0")
    except OSError:
        env = []
    cuda = next((v.split(b"=", 1)[1].decode() for v in env if v.startswith(b"CUDA_VISIBLE_DEVICES=")), None)
    table.append([pid, f[0], int(f[1]), int(f[2]), int(f[3]), int(f[19]), argv, cuda])
print(json.dumps(table))
"""

# argv: a JSON list of [argv, extra environment]; starts each in its own session, detached from
# the connection, and prints [[pid, start time], ...].
SPAWN = r"""
import json, os, subprocess, sys
started = []
for argv, extra in json.loads(sys.argv[1]):
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True,
                            env=dict(os.environ, **extra))
    with open(f"/proc/{proc.pid}/stat") as fh:
        stat = fh.read()
    started.append([proc.pid, int(stat[stat.rfind(")") + 2:].split()[19])])
print(json.dumps(started))
"""

# argv: a JSON list of [pid, start time]; SIGKILLs each session those processes lead, only while
# the leader still has its start time (a reused pid is left alone), and prints the pids signalled.
KILL_SESSIONS = r"""
import json, os, signal, sys, time
def stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()
leaders = [pid for pid, start in json.loads(sys.argv[1]) if (stat(pid) or [0] * 20)[19] == str(start)]
killed = []
for entry in os.listdir("/proc"):
    fields = stat(entry) if entry.isdigit() else None
    if fields and int(fields[3]) in leaders:
        try:
            os.kill(int(entry), signal.SIGKILL)
            killed.append(int(entry))
        except ProcessLookupError:
            pass
time.sleep(0.2)
print(json.dumps(killed))
"""

# A zombie whose parent lives: prints [zombie pid, its start time, parent pid, parent start time].
ZOMBIE = r"""
import json, os, subprocess, sys, time
parent = subprocess.Popen([sys.executable, "-c",
    "import os, sys, time\n"
    "child = os.fork()\n"
    "if child == 0:\n"
    "    os._exit(0)\n"
    "print(child, flush=True)\n"
    "time.sleep(3600)\n"],
    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
zombie = int(parent.stdout.readline())
def start(pid):
    with open(f"/proc/{pid}/stat") as fh:
        text = fh.read()
    return text[text.rfind(")") + 2:].split()
for _ in range(100):
    if start(zombie)[0] == "Z":
        break
    time.sleep(0.05)
print(json.dumps([zombie, int(start(zombie)[19]), parent.pid, int(start(parent.pid)[19])]))
"""


@dataclass(frozen=True)
class Proc:
    pid: int
    state: str
    ppid: int
    pgid: int
    sid: int
    start_time: int
    argv: tuple
    cuda: str | None

    @property
    def alive(self):
        return self.state not in ("Z", "X")


def _json_of(done, what):
    if done.returncode != 0:
        pytest.fail(f"{what} failed (rc {done.returncode}): {done.stdout}\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def container_python(fleet, vmid, program, *args, timeout=60):
    """Run a standard-library program with the container's python3; returns its JSON answer."""
    argv = " ".join(shlex.quote(a) for a in ("/usr/bin/python3", "-c", program, *args))
    return _json_of(fleet.ct(vmid, argv, timeout=timeout), f"CT {vmid}: python3 -c ...")


def process_table(fleet, vmid):
    """{pid: Proc} of every process in the container (pids as the container sees them)."""
    return {row[0]: Proc(row[0], row[1], row[2], row[3], row[4], row[5], tuple(row[6]), row[7])
            for row in container_python(fleet, vmid, PROCESS_TABLE)}


def still_there(table, pid, start_time):
    """Whether `pid` is live in `table` and is still the process that started at `start_time`."""
    proc = table.get(pid)
    return proc is not None and proc.alive and proc.start_time == start_time


def spawn(fleet, vmid, commands):
    """Start detached processes in the container, each in its own session (they outlive the
    pct exec); `commands` is a list of (argv, extra environment). Returns [(pid, start time)]."""
    answer = container_python(fleet, vmid, SPAWN, json.dumps([[list(a), dict(e)] for a, e in commands]))
    return [tuple(pair) for pair in answer]


def kill_sessions(fleet, vmid, leaders):
    """SIGKILL the sessions led by processes this test started, given as (pid, start time)."""
    if leaders:
        container_python(fleet, vmid, KILL_SESSIONS, json.dumps([list(p) for p in leaders]))


def make_zombie(fleet, vmid):
    """(zombie pid, its start time, parent pid, parent start time): a child that exited and that
    its live parent (in its own session) never reaps."""
    return tuple(container_python(fleet, vmid, ZOMBIE))


def run_group(table, record):
    """{pid: start time} of the run the pidfile `record` names: its process group and every
    descendant of its pid, as the container shows them now."""
    members = {p.pid: p.start_time for p in table.values() if p.pgid == record["pgid"] and p.alive}
    pending = [record["pid"], *members]
    while pending:
        parent = pending.pop()
        for proc in table.values():
            if proc.ppid == parent and proc.alive and proc.pid not in members:
                members[proc.pid] = proc.start_time
                pending.append(proc.pid)
    return members


def is_run(proc):
    """A training run of any release: run.sh before its exec, the trainer after it, as the leader
    of its own process group (what training_run starts)."""
    argv = list(proc.argv)
    started_as_run = any(a.endswith("/run.sh") for a in argv[:2])
    trainer = any(a == "-m" and b == "dflash_ops.train" for a, b in zip(argv, argv[1:], strict=False))
    return proc.alive and proc.pid == proc.pgid and (started_as_run or trainer)


def gpu_memory(fleet, vmid):
    """{GPU index: memory used (MiB)} from the container's nvidia-smi."""
    done = fleet.ct(vmid, "nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits")
    assert done.returncode == 0, done.stderr
    return {int(i): int(m) for i, m in (line.split(",") for line in done.stdout.splitlines() if line.strip())}


def training_run(fleet, vmid, timeout=180, **args):
    """training_run with `args`, run in the container by the project's module file (no Ansible);
    returns its result (failed: true when it failed)."""
    payload = json.dumps({"ANSIBLE_MODULE_ARGS": args})
    command = f"PYTHONPATH={shlex.quote(str(REPO))} " + " ".join(
        shlex.quote(a) for a in (VENV_PYTHON, str(MODULES / "training_run.py"), payload))
    done = fleet.ct(vmid, command, timeout=timeout)
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        pytest.fail(f"CT {vmid}: training_run printed no JSON (rc {done.returncode}):\n"
                    f"{done.stdout}\n{done.stderr}")
    assert "Traceback" not in json.dumps(result), result
    return result


def results_with(play, host, key):
    """Every result of `host` in a play that carries `key` (module results, whatever the task's name)."""
    return [result for _, name, result in play.host_results() if name == host and key in result]


def rng_for(test_name):
    """A random generator whose seed is printed (DFLASH_RELIABILITY_SEED replays a run)."""
    seed = int(os.environ.get("DFLASH_RELIABILITY_SEED") or random.SystemRandom().randrange(2**32))
    print(f"\n{test_name}: seed {seed} (DFLASH_RELIABILITY_SEED={seed} replays it)")
    return random.Random(seed), seed


def trainer_processes(fleet, vmid):
    """The trainer's processes in the container (launcher, torchrun, workers), as `ps` lists them."""
    res = fleet.ct(vmid, "ps -eo pid,args")
    return [line for line in res.stdout.splitlines()
            if "dflash_ops." in line or "torch.distributed.run" in line]


def hosts(vmids):
    return ",".join(f"ct{v}" for v in vmids)


def live_run(fleet, vmid):
    """The pidfile's record when it names a live run, else None."""
    try:
        record = fleet.run_info(vmid)
    except ValueError:  # a pidfile a test left garbled
        return None
    if not record:
        return None
    table = process_table(fleet, vmid)
    return record if still_there(table, record["pid"], record["start_time"]) else None


def ensure_runs(fleet, vmids, live):
    """Bring the runs of `vmids` to live (deploy.yml starts a stopped run) or stopped."""
    todo = [v for v in vmids if (live_run(fleet, v) is not None) != live]
    if not todo:
        return
    if live:
        res = fleet.play("deploy.yml", "-l", hosts(todo), "-e", f"dflash_fleet_serial={len(todo)}",
                         timeout=1800)
    else:
        res = fleet.play("stop_training.yml", "-l", hosts(todo), timeout=900)
    if res.rc != 0:
        pytest.fail(f"could not bring the runs of {todo} to {'live' if live else 'stopped'}: {res}")
