"""Shared by the benchmarks that run the playbooks against pvesim (`restart_cycle`, `fleet`).

A sim and its deploy setup come from the role tests' helpers (`tests/roles/roles_support.py`:
`Fleet`, a pvesim in its own state dir with the sim inventory's group_vars, a snapshot of the source
and the tiny demo assets). Plays run with the `ansible.posix.json` callback, whose per-task start and
end times are the profile here: each task's wall time (the slowest host of its batch), what kind
of work it is (from the task file it comes from and its action), and what ran on the controller,
on a node over ssh, or in a container through `pct_pipelined`.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO / "tests" / "roles", REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from roles_support import VENV_BIN, Fleet, ansible_env  # noqa: E402

import pvesim  # noqa: E402

__all__ = ["REPO", "VENV_BIN", "Fleet", "ansible_env", "pvesim", "bring_up", "timed_play", "task_rows",
           "categorize", "summarize_categories", "median", "timed", "recap"]

# Actions that run inside the controller's ansible-playbook process: no connection at all.
IN_PROCESS = {
    "ansible.builtin.assert", "ansible.builtin.set_fact", "ansible.builtin.debug", "ansible.builtin.fail",
    "ansible.builtin.include_role", "ansible.builtin.include_tasks", "ansible.builtin.import_tasks",
    "ansible.builtin.validate_argument_spec", "ansible.builtin.meta", "ansible.builtin.pause",
}
TRANSFER = {"ansible.builtin.copy", "ansible.builtin.unarchive", "ansible.builtin.template"}

CATEGORIES = (
    "controller: wheel build, git, pack",
    "node checks (ssh to the node)",
    "venv: create, .pth, wheel (one module call)",
    "release: unpack, validate, switch (one module call)",
    "file transfer (cat through pct exec)",
    "run stop + GPU idle check",
    "run start + health (waits, polls, gpu_verify)",
    "other container round trips",
    "in-process (assert, set_fact, include)",
)


def bring_up(base: Path, nodes: int, containers) -> Fleet:
    """A `Fleet` in `base`; on a failed start, whatever came up is taken down again."""
    try:
        return Fleet(base, nodes=nodes, containers=tuple(containers))
    except BaseException:
        pvesim.down(base / "state")
        raise


def median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 2) if values else None


def timed(fn, *args, **kwargs):
    started = time.monotonic()
    out = fn(*args, **kwargs)
    return time.monotonic() - started, out


def timed_play(fleet: Fleet, playbook: str, *args, keep_json: Path | None = None, timeout=1200):
    """(wall seconds, PlayResult) of one ansible-playbook run, process start to exit. The play's
    ansible.posix.json output is also written to `keep_json` when given; a failed play ends the
    benchmark with its output."""
    wall, res = timed(fleet.play, playbook, *args, timeout=timeout)
    if keep_json:
        keep_json.parent.mkdir(parents=True, exist_ok=True)
        keep_json.write_text(json.dumps(res.data))
    if res.rc != 0:
        raise SystemExit(f"{playbook} {' '.join(args)} failed:\n{res}")
    return wall, res


def _ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def task_rows(data: dict) -> list[dict]:
    """One row per task run (per batch): name, file, action, start/end epoch, seconds, host results."""
    rows = []
    for play in data.get("plays", []):
        for task in play.get("tasks", []):
            hosts = task.get("hosts", {})
            actions = {r.get("action") for r in hosts.values() if r.get("action")}
            dur = task["task"]["duration"]
            start, end = _ts(dur["start"]), _ts(dur.get("end", dur["start"]))
            rows.append({
                "play": play["play"]["name"],
                "name": task["task"]["name"],
                "path": task["task"].get("path", ""),
                "action": next(iter(actions), None),
                "start": start,
                "end": end,
                "seconds": end - start,
                "hosts": hosts,
                "ran": [h for h, r in hosts.items() if not r.get("skipped")],
            })
    return rows


def categorize(row: dict) -> str | None:
    """The kind of work a task run is, or None when every host skipped it."""
    if not row["ran"]:
        return None
    name, path, action = row["name"], row["path"], row["action"]
    file = Path(path.split(":")[0]).name
    role = path.split("/roles/")[1].split("/")[0] if "/roles/" in path else ""
    if action in IN_PROCESS and action != "ansible.builtin.pause":
        return "in-process (assert, set_fact, include)"
    if "on the controller" in name:
        return "controller: wheel build, git, pack"
    if role == "proxmox_host" or (action or "").endswith("pct_container_check"):
        return "node checks (ssh to the node)"
    if role == "dflash_run" and file == "stop.yml":
        return "run stop + GPU idle check"
    if role == "dflash_run" and file in ("start.yml", "launch.yml", "health.yml"):
        return "run start + health (waits, polls, gpu_verify)"
    if action in TRANSFER:
        return "file transfer (cat through pct exec)"
    if role == "dflash_env" and file in ("venv.yml", "requirements.yml"):
        return "venv: create, .pth, wheel (one module call)"
    if role == "dflash_release" and file == "live.yml":
        return "release: unpack, validate, switch (one module call)"
    return "other container round trips"


def summarize_categories(rows: list[dict]) -> dict:
    """{category: {"tasks": n, "seconds": s}} over the task runs that did something."""
    out = {c: {"tasks": 0, "seconds": 0.0} for c in CATEGORIES}
    for row in rows:
        cat = categorize(row)
        if cat is None:
            continue
        out[cat]["tasks"] += 1
        out[cat]["seconds"] += row["seconds"]
    return {c: {"tasks": v["tasks"], "seconds": round(v["seconds"], 2)} for c, v in out.items()}


def remote_task_seconds(rows: list[dict]) -> list[float]:
    """Wall times of the single-round-trip container tasks (stat, file, find): what one task through
    pct_pipelined costs when the module itself does almost nothing."""
    cheap = {"ansible.builtin.stat", "ansible.builtin.file", "ansible.builtin.find"}
    return [r["seconds"] for r in rows if r["ran"] and r["action"] in cheap
            and categorize(r) != "node checks (ssh to the node)"]


def recap(result, hosts) -> dict:
    """{host: changed count} from a play's recap."""
    return {h: s.get("changed") for h, s in result.stats.items() if h in hosts}


def ansible_adhoc(inventory, pattern, module, args=None, timeout=300, verbose=False):
    """Wall seconds and result of one ad-hoc `ansible` run (the project's ansible.cfg, default callback)."""
    argv = [str(VENV_BIN / "ansible"), "-i", str(inventory), pattern, "-m", module]
    if args:
        argv += ["-a", args]
    if verbose:
        argv.append("-vvv")
    started = time.monotonic()
    res = subprocess.run(argv, env=ansible_env(), capture_output=True, text=True, timeout=timeout,
                         cwd=REPO, stdin=subprocess.DEVNULL)
    return time.monotonic() - started, res


