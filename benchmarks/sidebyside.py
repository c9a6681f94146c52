"""This tree's playbooks and collection against a baseline revision's, run side by side on one sim.

A baseline is `git archive <rev>` of what runs on the controller (ansible.cfg, playbooks/, the collection,
the sim inventory's group_vars) unpacked into a temporary directory: its own ansible.cfg (so its own
collection and forks), its own group_vars next to a link to the sim's hosts.yml. Both trees deploy the
same trainer source (the fleet's snapshot) to the same containers.

`measured_play` runs `ansible-playbook` itself, not through ansible-runner (whose event callback would add
its own work to every task): wall time, and the CPU seconds of the `ansible-playbook` process tree on the
controller from `wait4` (the process and every worker, ssh client and command it waited for: what
`/usr/bin/time ansible-playbook` reports). Host results are counted from its output (skipped hosts shown).
Beside it, the CPU seconds the simulated nodes spent meanwhile: each node's sshd and everything under it
(sessions, `pct`, `lxc-attach`, the modules in the containers), which on a real fleet run on the nodes'
own CPUs and here share the machine's with the controller.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pvesim.fleet import REPO, VENV_BIN, ansible_env, run_playbook

# What runs on the controller, and what the sim inventory adds.
TREE_PATHS = ("ansible.cfg", "playbooks", "ansible_collections/dflash", "inventory/sim/group_vars")
# A host's result line in ansible-playbook's default output: one per task run on that host.
HOST_RESULT = re.compile(r"^(ok|changed|skipping|fatal|failed|rescued): \[([^\]\s]+)")


@dataclass(frozen=True)
class Tree:
    """A checkout of the controller's side: this repository or a baseline revision unpacked."""

    label: str
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "ansible.cfg"

    @property
    def forks(self) -> int:
        cfg = configparser.ConfigParser()
        cfg.read(self.config)
        return cfg.getint("defaults", "forks", fallback=5)

    def playbook(self, name: str) -> Path:
        return self.root / "playbooks" / name

    def inventory(self, fleet) -> Path:
        """The fleet's hosts.yml with this tree's sim group_vars beside it."""
        if self.root == REPO:
            return fleet.inventory
        directory = fleet.base / f"inventory-{self.label}"
        if not directory.exists():
            directory.mkdir()
            (directory / "hosts.yml").symlink_to(fleet.inventory)
            (directory / "group_vars").symlink_to(self.root / "inventory" / "sim" / "group_vars")
        return directory / "hosts.yml"

    def env(self, fleet, **extra) -> dict:
        return {"ANSIBLE_CONFIG": str(self.config), "ANSIBLE_HOST_KEY_CHECKING": "True",
                "DFLASH_SIM_ASSETS": str(fleet.assets), **extra}


THIS_TREE = Tree("this tree", REPO)


def baseline(rev: str, work: Path) -> Tree:
    """The controller's side of revision `rev`, unpacked under `work`."""
    root = Path(tempfile.mkdtemp(prefix="baseline-", dir=work))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev, *TREE_PATHS],
                             capture_output=True, check=True).stdout
    archive_path = root / "tree.tar"
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(root, filter="data")
    archive_path.unlink()
    label = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], capture_output=True,
                           text=True, check=True).stdout.strip()
    return Tree(label if label.startswith(rev) or rev.startswith(label) else f"{rev} ({label})", root)


def process_times() -> dict:
    """{pid: (ppid, own CPU seconds + those of its children it waited for)} of every process."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(entry)] = (int(fields[1]), sum(int(f) for f in fields[11:15]) / tick)
    return out


def nodes_cpu_seconds(fleet) -> float:
    """CPU seconds so far of the sim's nodes: each node's sshd and its live descendants, each with what it
    waited for (a process that ended is counted in its parent's)."""
    times = process_times()
    children = {}
    for pid, (ppid, _) in times.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [n.sshd_pid for n in fleet.sim.nodes if n.sshd_pid in times]
    while todo:
        pid = todo.pop()
        total += times[pid][1]
        todo.extend(children.get(pid, []))
    return total


def measured_play(fleet, tree: Tree, playbook: str, *args) -> dict:
    """One `ansible-playbook` of `tree` against the fleet: wall and controller CPU seconds, host results
    per host, the load average before and after. A failed play ends the benchmark with its output."""
    source = {"dflash_release_source_dir": str(fleet.src / "dflash_ops")}
    argv = [str(VENV_BIN / "ansible-playbook"), "-i", str(tree.inventory(fleet)),
            str(tree.playbook(playbook)), "-e", json.dumps(source), *args]
    env = ansible_env(**tree.env(fleet, ANSIBLE_DISPLAY_SKIPPED_HOSTS="True"))
    load = os.getloadavg()[0]
    nodes_before = nodes_cpu_seconds(fleet)
    started = time.monotonic()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=tree.root)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, for its rusage
        wall = time.monotonic() - started
        nodes = nodes_cpu_seconds(fleet) - nodes_before
        out.seek(0)
        text = out.read()
    if proc.returncode != 0:
        raise SystemExit(f"{tree.label}: {playbook} {' '.join(args)} failed:\n{text[-4000:]}")
    per_host = {}
    for line in text.splitlines():
        match = HOST_RESULT.match(line)
        if match:
            per_host[match.group(2)] = per_host.get(match.group(2), 0) + 1
    return {"wall_s": round(wall, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
            "nodes_cpu_s": round(nodes, 2), "host_results": per_host,
            "loadavg_1min": [round(load, 2), round(os.getloadavg()[0], 2)]}


def tree_play(fleet, tree: Tree, playbook: str, *args, timeout=1200):
    """A playbook of `tree` through ansible-runner (its event stream: each task's results and timing)."""
    (fleet.base / "plays").mkdir(exist_ok=True)
    private = Path(tempfile.mkdtemp(prefix=f"{Path(playbook).stem}-", dir=fleet.base / "plays"))
    return run_playbook(str(tree.playbook(playbook)), tree.inventory(fleet), *args, timeout=timeout,
                        keep_dir=private, envvars=tree.env(fleet),
                        extravars={"dflash_release_source_dir": str(fleet.src / "dflash_ops")})


def reset_containers(fleet, vmids) -> None:
    """Every container back to before its first deploy (no venv, release, run state or log), and the
    controller's release archives gone: the next deploy does all its work again."""
    for vmid in vmids:
        res = fleet.ct(vmid, "rm -rf /opt/dflash /var/lib/dflash /var/log/dflash", timeout=120)
        if res.returncode != 0:
            raise SystemExit(f"CT {vmid}: cannot reset: {res.stderr}")
    shutil.rmtree(fleet.build_dir, ignore_errors=True)
