"""Helpers for the bad-input and infrastructure-fault tests: a fleet whose playbooks can run against
another inventory, what a playbook showed the user, and a snapshot of what runs in a container."""

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from pvesim.fleet import SIM_GROUP_VARS, VENV_BIN, Fleet, ansible_env

REPO = Path(__file__).resolve().parents[2]
RELIABILITY_DOC = REPO / "docs" / "RELIABILITY.md"  # its tables list the cases


class InputFleet(Fleet):
    """A Fleet whose playbooks run against `self.inventory_override` when it is set."""

    inventory_override = None

    @property
    def inventory(self):
        return self.inventory_override or self.sim.inventory_path

    def inventory_copy(self, directory, edit):
        """A copy of the fleet's inventory in `directory` (hosts.yml, the sim group_vars), with
        `edit(data)` applied to hosts.yml's data."""
        directory.mkdir(parents=True, exist_ok=True)
        data = yaml.safe_load(self.sim.inventory_path.read_text())
        edit(data)
        (directory / "hosts.yml").write_text(yaml.safe_dump(data, sort_keys=False))
        (directory / "group_vars").symlink_to(SIM_GROUP_VARS)
        return directory / "hosts.yml"

    def adhoc(self, pattern, *args, timeout=120):
        """An ad-hoc `ansible <pattern> <args>` against the fleet's inventory (text output)."""
        argv = [str(VENV_BIN / "ansible"), "-i", str(self.inventory), pattern, *args]
        return subprocess.run(argv, env=ansible_env(), capture_output=True, text=True, timeout=timeout,
                              cwd=REPO, stdin=subprocess.DEVNULL)

    def node_sh(self, vmid, command):
        """Run a shell command on the container's node; fail loudly if it fails."""
        res = self.sim.ssh(self.sim.node_of(vmid).name, command)
        assert res.returncode == 0, f"{command}: {res.stderr}"
        return res.stdout

    def ct_sh(self, vmid, command):
        """Run a shell command in a container; fail loudly if it fails."""
        res = self.ct(vmid, command)
        assert res.returncode == 0, f"CT {vmid}: {command}: {res.stdout} {res.stderr}"
        return res.stdout


def shown(res):
    """What the user sees of a failed playbook: the failure messages (a loop's per item) and the
    unreachable hosts', else what Ansible printed."""
    return "\n".join(filter(None, [failures(res), unreachable(res)])) or (res.stderr + res.stdout)[-4000:]


def task_results(res):
    """(host, result) of every task of a playbook run, a loop's items after their task."""
    for _, host, result in res.host_results():
        yield host, result
        for item in result.get("results", []) if isinstance(result.get("results"), list) else []:
            if isinstance(item, dict):
                yield host, item


def failures(res):
    return "\n".join(f"{host}: {result.get('msg')}" for host, result in task_results(res)
                     if result.get("failed") and "msg" in result)


def unreachable(res):
    """The messages of the hosts a playbook could not reach, one line each."""
    return "\n".join(f"{host}: UNREACHABLE: {result.get('msg')}" for host, result in task_results(res)
                     if result.get("unreachable"))


@dataclass(frozen=True)
class RunSnapshot:
    """What runs in a container: the run's pidfile record, whether its pid lives, the live release."""

    pid: int | None
    pgid: int | None
    argv: tuple
    alive: bool
    release: str

    @classmethod
    def take(cls, fleet, vmid):
        info = fleet.run_info(vmid) or {}
        pid = info.get("pid")
        return cls(pid=pid, pgid=info.get("pgid"), argv=tuple(info.get("argv") or ()),
                   alive=bool(pid) and fleet.alive(vmid, pid), release=fleet.live_release(vmid))


def doc_table(heading, first_column):
    """Rows of the first table under `heading` in docs/RELIABILITY.md whose first header cell is
    `first_column`: a list of lists of cell texts."""
    text = RELIABILITY_DOC.read_text()
    start = text.find(f"\n{heading}\n")
    assert start >= 0, f"docs/RELIABILITY.md has no section {heading!r}"
    section = text[start + len(heading) + 2:]
    section = section[:section.find("\n## ")] if "\n## " in section else section
    rows, inside = [], False
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells and not inside and cells[0].lower() == first_column:
            inside = True
        elif cells and inside and not re.fullmatch(r"[-: |]+", line):
            rows.append(cells)
        elif inside and not cells:
            break
    return rows


def deployed_fleet(base, nodes, containers):
    """The body of a module fixture: an InputFleet with a run deployed in each container (two at a
    time), taken down at the end, also when that first deploy fails."""
    fleet = InputFleet(base, nodes=nodes, containers=containers)
    try:
        res = fleet.play("deploy.yml", "-e", "dflash_fleet_serial=2")
        assert res.rc == 0, str(res)
        yield fleet
    finally:
        fleet.down()
