#!/usr/bin/python
# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Ansible modules keep their imports below the documentation blocks.
# ruff: noqa: E402
from __future__ import annotations

DOCUMENTATION = r"""
---
module: run_report
short_description: Everything the status table shows of one training run, read in one call
description:
  - Reads, without changing anything, what C(playbooks/status.yml) shows of a run in its container; one
    round trip instead of one per item.
  - The run's state from its pidfile, judged as M(dflash.ops.training_run) judges it (V(running), or
    V(stopped) with RV(ended) when the pidfile names a run that ended without a stop), and the end of its
    log when it ended so.
  - The jobs O(jobs) started beside the run (a regeneration, a feature capture) that are running, each with
    its pid and its log's last line (how far it got).
  - The live release (where O(root)C(/current) points), the release the run was started from (the
    directory of its program), the run's C(status.json) in O(output_dir), and the GPUs O(gpus) as
    C(nvidia-smi) shows them (an error reading them is reported, not failed on).
version_added: "0.3.0"
author: dflash-ops contributors (@dflash-ops)
extends_documentation_fragment:
  - dflash.ops.attributes
  - dflash.ops.attributes.read_only
options:
  name:
    description: Name of the run (the default paths are named after it).
    type: str
    default: main
  jobs:
    description:
      - Names of jobs started like a run by M(dflash.ops.training_run), their pidfile C(<job>.pid) beside the
        run's O(pidfile) and their log C(<job>.log) beside its O(log_path). Those running are reported in
        RV(jobs).
    type: list
    elements: str
    default: [regenerate, capture]
  pidfile:
    description: The run's pidfile. Defaults to C(/var/lib/dflash/<name>.pid).
    type: path
  log_path:
    description: The run's log. Defaults to C(/var/log/dflash/<name>.log).
    type: path
  root:
    description: The base directory holding the C(current) release symlink.
    type: path
    default: /opt/dflash
  output_dir:
    description: The run's output directory, which holds its C(status.json).
    type: path
    required: true
  gpus:
    description: Indices of the run's GPUs to read with C(nvidia-smi); none read when empty.
    type: list
    elements: int
    default: []
  stalled_after:
    description:
      - Seconds without a step after which a live run whose C(status.json) says V(running) is reported
        RV(stalled). A run still starting (C(status.json) says V(starting), or is still the previous run's,
        written before this run started) or stopping is never stalled; a held-out pass writes nothing
        until it ends, so the window must be longer than the run's longest held-out pass.
    type: int
    default: 900
"""

EXAMPLES = r"""
- name: Read the run's state, its status.json, the live release and its GPUs.
  dflash.ops.run_report:
    name: main
    root: /opt/dflash
    output_dir: /var/lib/dflash/runs/main
    gpus: [0, 1, 2, 3, 4, 5, 6, 7]
  register: report
"""

RETURN = r"""
state:
  description: V(running) or V(stopped).
  returned: always
  type: str
ended:
  description: Whether the pidfile names a run that is gone (it ended without a stop; a stop removes it).
  returned: always
  type: bool
pid:
  description: The running run's pid, or null.
  returned: always
  type: int
log_tail:
  description: The end of the run's log when it ended without a stop, else empty.
  returned: always
  type: str
release:
  description: The name of the live release (where C(current) points), C(-) when none is live.
  returned: always
  type: str
running_release:
  description: The name of the release the run was started from, C(-) when the pidfile names no run.
  returned: always
  type: str
progress:
  description: The run's C(status.json) (empty when it has none or it is not JSON).
  returned: always
  type: dict
gpus:
  description: The GPUs of O(gpus) as M(dflash.ops.gpu_verify) returns them.
  returned: always
  type: list
  elements: dict
started_by:
  description: Who started the live run (C(boot) when its container's boot started it again), else empty.
  returned: always
  type: str
started_at:
  description: When the live run was started (ISO 8601), else empty.
  returned: always
  type: str
boot:
  description:
    - What the container's last boot did with the run (dflash-resume's C(<name>.boot-result.json) beside
      the pidfile), {} when it did nothing.
  returned: always
  type: dict
gpu_error:
  description: Why the GPUs could not be read, else empty.
  returned: always
  type: str
pidfile_unsafe:
  description: Why the pidfile is not trusted (owner, mode, directory).
  returned: when it is not
  type: str
step_age:
  description:
    - Seconds since C(status.json) was last written by the run (its C(updated_at), which each step
      rewrites), by the container's clock; null when it has none or names no time.
  returned: always
  type: int
run_state:
  description:
    - The run's state as C(status.yml) shows it, one source for its table and its O(stalled_after) check.
      V(running); V(stalled) (live, no step for over O(stalled_after)); V(stopped) (by a stop, which
      removes the pidfile); or, when it ended without a stop, what its C(status.json) last said,
      V(finished) (it wrote C(stopped)), V(failed) (the trainer or torchrun gave up) or V(died) (killed or
      crashed mid-run).
  returned: always
  type: str
stalled:
  description:
    - Whether the run is live, C(status.json) (written since this run started) says V(running) and
      RV(step_age) is over O(stalled_after).
  returned: always
  type: bool
jobs:
  description:
    - The running jobs of O(jobs), each C(name), C(pid), C(started_at) and C(last) (its log's last line).
  returned: always
  type: list
  elements: dict
"""

import json
import os
import time
from datetime import datetime

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.dflash.ops.plugins.module_utils.gpu_state import poll
from ansible_collections.dflash.ops.plugins.module_utils.nvidia_smi import NvidiaSmiError, find_executable
from ansible_collections.dflash.ops.plugins.module_utils.run_pidfile import RunError, inspect
from ansible_collections.dflash.ops.plugins.module_utils.run_start import last_log_line, log_tail
from ansible_collections.dflash.ops.plugins.module_utils.safe_paths import UnsafePath, open_file

ARGUMENT_SPEC = dict(
    name=dict(type="str", default="main"),
    pidfile=dict(type="path"),
    log_path=dict(type="path"),
    root=dict(type="path", default="/opt/dflash"),
    output_dir=dict(type="path", required=True),
    gpus=dict(type="list", elements="int", default=[]),
    jobs=dict(type="list", elements="str", default=["regenerate", "capture"]),
    stalled_after=dict(type="int", default=900),
)


def epoch(text):
    """Seconds since the epoch of an ISO 8601 time with its offset, None for anything else."""
    if not isinstance(text, str) or not text:
        return None
    try:
        moment = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    except ValueError:
        return None
    return moment.timestamp() if moment.tzinfo is not None else None


def step_age(progress, started_at, stalled_after, live, now=None):
    """(age, stalled) of a run: the seconds since its status.json was written (`updated_at`, rewritten
    at each step), and whether a live run says `running` but took no step for over `stalled_after`
    seconds. A status.json written before the run started (`started_at`, its pidfile's) is the previous
    run's: the run is still starting, never stalled; so is one that says `starting` (loading the models)
    or `stopping`."""
    now = time.time() if now is None else now
    updated, started = epoch(progress.get("updated_at")), epoch(started_at)
    if updated is None:
        return None, False
    age = max(0, int(now - updated))
    own = started is None or updated >= started
    return age, bool(live and own and progress.get("state") == "running" and age > stalled_after)


def run_state(result):
    """The state status.yml shows for a report: running, stalled, stopped, finished, failed or died."""
    if result["state"] == "running":
        return "stalled" if result["stalled"] else "running"
    if not result["ended"]:
        return "stopped"
    said = result["progress"].get("state")
    return {"failed": "failed", "stopped": "finished"}.get(said, "died")


def release_name(path):
    """The last part of a release's directory, `-` for none."""
    return os.path.basename(os.path.normpath(path)) if path else "-"


def read_object(path, owner=None):
    """A JSON object file as data, never read through a symbolic link or from a file other users could
    write; {} when it is missing, unreadable, not trusted or not a JSON object. `owner`: the uid of the
    run's user (the pidfile's `uid`), whose file and directories it may be (status.json)."""
    try:
        with os.fdopen(open_file(path, owner=owner), "rb") as handle:
            data = json.load(handle)
    except (OSError, ValueError, UnsafePath):
        return {}
    return data if isinstance(data, dict) else {}


def read_gpus(indices):
    """(gpus, error) of the run's GPUs; an error is reported as text, never raised."""
    if not indices:
        return [], ""
    executable = find_executable()
    if executable is None:
        return [], f"nvidia-smi not found (PATH={os.environ.get('PATH')})"
    try:
        seen = poll(executable, "any", indices, 0)
    except NvidiaSmiError as exc:
        return [], str(exc)
    return seen["gpus"], "; ".join(seen["reasons"])


def running_jobs(params):
    """Each job of `jobs` whose pidfile names a live process: its name, pid, start and last log line."""
    jobs = []
    for name in params["jobs"]:
        if name == params["name"]:
            continue
        record, verdict = inspect(os.path.join(os.path.dirname(params["pidfile"]), f"{name}.pid"))[:2]
        if verdict == "live" and isinstance(record, dict):
            log = os.path.join(os.path.dirname(params["log_path"]), f"{name}.log")
            jobs.append({"name": name, "pid": record.get("pid"), "started_at": record.get("started_at", ""),
                         "last": last_log_line(log)})
    return jobs


def report(params):
    record, verdict, unsafe = inspect(params["pidfile"])
    run = record if isinstance(record, dict) else {}
    argv0 = (run.get("argv") or [""])[0]
    gpus, gpu_error = read_gpus(params["gpus"])
    current = os.path.join(params["root"], "current")
    boot_result = os.path.join(os.path.dirname(params["pidfile"]), f"{params['name']}.boot-result.json")
    result = dict(
        changed=False, state="running" if verdict == "live" else "stopped",
        ended=verdict not in ("absent", "live"),
        pid=run.get("pid") if verdict == "live" else None,
        log_tail=log_tail(params["log_path"]) if verdict not in ("absent", "live") else "",
        release=release_name(os.readlink(current)) if os.path.islink(current) else "-",
        running_release=release_name(os.path.dirname(argv0)),
        progress=read_object(os.path.join(params["output_dir"], "status.json"), run.get("uid")),
        started_by=run.get("started_by", "") if verdict == "live" else "",
        started_at=run.get("started_at", "") if verdict == "live" else "",
        boot=read_object(boot_result),
        gpus=gpus, gpu_error=gpu_error, jobs=running_jobs(params))
    result["step_age"], result["stalled"] = step_age(result["progress"], run.get("started_at", ""),
                                                     params["stalled_after"], verdict == "live")
    result["run_state"] = run_state(result)
    if unsafe:
        result["pidfile_unsafe"] = unsafe
    return result


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    params = module.params
    name = params["name"]
    params["pidfile"] = params["pidfile"] or f"/var/lib/dflash/{name}.pid"
    params["log_path"] = params["log_path"] or f"/var/log/dflash/{name}.log"
    try:
        module.exit_json(**report(params))
    except RunError as exc:
        module.fail_json(msg=str(exc), **exc.result)


if __name__ == "__main__":
    main()
