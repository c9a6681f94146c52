"""Shared by the benchmarks that run the playbooks against pvesim (`restart_cycle`, `fleet`).

A sim and its deploy setup come from `pvesim.fleet` (`Fleet`: a pvesim in its own state dir with the
sim inventory's group_vars, a snapshot of the source and the tiny demo assets), as in the tests.
Plays run through ansible-runner; its event stream gives each task run's start and end, which are the
profile here: each task's wall time (the slowest host of its batch), what kind of work it is (from the
task file it comes from and its action), and what ran on the controller, on a node over ssh, or in a
container through `pct_pipelined`.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path

from benchmarks import sidebyside
from pvesim import down
from pvesim.fleet import IN_PROCESS, Fleet, TaskRun, run_module

TRANSFER = {"ansible.builtin.copy", "ansible.builtin.unarchive", "ansible.builtin.template"}

CATEGORIES = (
    "controller: git, pack",
    "node checks (ssh to the node)",
    "venv: create, .pth (one module call)",
    "release: unpack, validate, switch (one module call)",
    "file transfer (cat through pct exec)",
    "run stop + GPU idle check",
    "run start + health (waits, polls, gpu_verify)",
    "other container round trips",
    "in-process (assert, set_fact, include)",
)


def bring_up(base: Path, nodes: int, containers, **layout) -> Fleet:
    """A `Fleet` in `base`; on a failed start, whatever came up is taken down again."""
    try:
        return Fleet(base, nodes=nodes, containers=tuple(containers), **layout)
    except BaseException:
        down(base / "state")
        raise


def median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


def timed(fn, *args, **kwargs):
    started = time.monotonic()
    out = fn(*args, **kwargs)
    return time.monotonic() - started, out


def timed_play(fleet: Fleet, playbook: str, *args, keep_json: Path | None = None, timeout=1200, tree=None):
    """(wall seconds, PlayResult) of one playbook run through ansible-runner, start to exit: this tree's
    playbook, or `tree`'s (a baseline's, `benchmarks.sidebyside`). The play's task runs (from the event
    stream) and recap are also written to `keep_json` when given; a failed play ends the benchmark with
    its output."""
    if tree is None:
        wall, res = timed(fleet.play, playbook, *args, timeout=timeout)
    else:
        wall, res = timed(sidebyside.tree_play, fleet, tree, playbook, *args, timeout=timeout)
    if keep_json:
        keep_json.parent.mkdir(parents=True, exist_ok=True)
        keep_json.write_text(json.dumps({"plays": res.plays, "stats": res.stats,
                                         "tasks": [dataclasses.asdict(t) for t in res.tasks]}))
    if res.rc != 0:
        raise SystemExit(f"{playbook} {' '.join(args)} failed:\n{res}")
    return wall, res


def categorize(row: TaskRun) -> str | None:
    """The kind of work a task run is, or None when every host skipped it."""
    if not row.ran:
        return None
    name, path, action = row.name, row.path, row.action
    file = Path(path.split(":")[0]).name
    role = path.split("/roles/")[1].split("/")[0] if "/roles/" in path else ""
    if action in IN_PROCESS and action != "ansible.builtin.pause":
        return "in-process (assert, set_fact, include)"
    if "on the controller" in name:
        return "controller: git, pack"
    if role == "proxmox_host" or (action or "").endswith("pct_container_check"):
        return "node checks (ssh to the node)"
    if role == "dflash_run" and file == "stop.yml":
        return "run stop + GPU idle check"
    if role == "dflash_run" and file in ("start.yml", "launch.yml", "health.yml"):
        return "run start + health (waits, polls, gpu_verify)"
    if action in TRANSFER:
        return "file transfer (cat through pct exec)"
    if role == "dflash_env" and file in ("venv.yml", "requirements.yml"):
        return "venv: create, .pth (one module call)"
    if role == "dflash_release" and file == "live.yml":
        return "release: unpack, validate, switch (one module call)"
    return "other container round trips"


def summarize_categories(rows: list[TaskRun]) -> dict:
    """{category: {"tasks": n, "seconds": s}} over the task runs that did something."""
    out = {c: {"tasks": 0, "seconds": 0.0} for c in CATEGORIES}
    for row in rows:
        cat = categorize(row)
        if cat is None:
            continue
        out[cat]["tasks"] += 1
        out[cat]["seconds"] += row.seconds
    return {c: {"tasks": v["tasks"], "seconds": round(v["seconds"], 2)} for c, v in out.items()}


def remote_task_seconds(rows: list[TaskRun]) -> list[float]:
    """Wall times of the single-round-trip container tasks (stat, file, find): what one task through
    pct_pipelined costs when the module itself does almost nothing."""
    cheap = {"ansible.builtin.stat", "ansible.builtin.file", "ansible.builtin.find"}
    return [r.seconds for r in rows if r.ran and r.action in cheap
            and categorize(r) != "node checks (ssh to the node)"]


def recap(result, hosts) -> dict:
    """{host: changed count} from a play's recap."""
    return {h: s.get("changed") for h, s in result.stats.items() if h in hosts}


def ansible_adhoc(inventory, pattern, module, args=None, timeout=300, verbose=False):
    """Wall seconds and PlayResult of one ad-hoc module run through ansible-runner (the project's
    ansible.cfg; `verbose`: -vvv, whose lines land in the result's stdout)."""
    started = time.monotonic()
    res = run_module(module, args, inventory, pattern, timeout=timeout, verbosity=3 if verbose else None)
    return time.monotonic() - started, res
