# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Targets may run a Python older than 3.11 (no datetime.UTC).
# ruff: noqa: UP017
"""Runs that come back when their container boots.

The dflash_run role puts this program in the container (`dflash-resume.pyz`: it and the module_utils it
imports, standard library only) with a systemd unit, `dflash-resume.service`, that runs it at every boot
of the container, whatever started the container (the node's startall after the node's boot, `pct
start`). For each run the role started (its start file `<pidfile dir>/<name>.boot.json`: the start's
arguments and the run's GPUs) it starts the same argv again, the release's run.sh, which resumes from
the last complete checkpoint, as the same user (the start file's `user`), when all of these hold, under
the run's lock as a deploy would:

- the pidfile is there and names no live process: the run ended without a stop. Only a stop removes a
  pidfile, so a run stopped on purpose (stop_training.yml) stays stopped; a pidfile that is not trusted
  or names nothing is left to the operator;
- status.json says the run did not end by itself: it was starting, running or stopping (killed with its
  container), or it stopped on a signal (its container shut down). A finished or failed run stays so;
- on an NVSwitch (HGX) board, the GPUs' NVLink fabric is up: every Fabric State of `nvidia-smi -q` is
  Completed, waited for within the start file's fabric_timeout (Fabric Manager sets it up after the node's
  boot, and until it has, CUDA fails with error 802, a failed run that no boot starts again). A board
  whose `nvidia-smi -q` shows no fabric state (no NVSwitch, or GPUs older than Hopper, which have no
  Fabric section: the node's preflight checks their Fabric Manager) has nothing to wait for;
- its GPUs are idle, as gpu_verify judges them, within the start file's gpu_timeout: a container that
  comes back at the same time as another on the same GPUs does not start a run over the other's.

Each outcome is a JSON line on stdout and `<pidfile dir>/<name>.boot-result.json` (status.yml shows it);
the pidfile of a resumed run says `started_by: boot`.
"""

from __future__ import annotations

import glob
import json
import os
import time
from datetime import datetime, timezone

from ansible_collections.dflash.ops.plugins.module_utils.gpu_state import poll
from ansible_collections.dflash.ops.plugins.module_utils.nvidia_node import parse_fabric
from ansible_collections.dflash.ops.plugins.module_utils.nvidia_smi import (
    NvidiaSmiError,
    find_executable,
    run,
)
from ansible_collections.dflash.ops.plugins.module_utils.run_pidfile import (
    RunError,
    describe,
    inspect,
    pidfile_lock,
    remove_file,
    write_pidfile,
)
from ansible_collections.dflash.ops.plugins.module_utils.run_start import (
    base_environment,
    preflight,
    read_environment_file,
    run_identity,
    start_run,
)
from ansible_collections.dflash.ops.plugins.module_utils.safe_paths import UnsafePath, open_file

START_FILE = ".boot.json"
RESULT_FILE = ".boot-result.json"
STARTED_BY = "boot"
GPU_POLL_SECONDS = 2
FABRIC_POLL_SECONDS = 2
FABRIC_TIMEOUT = 600  # Fabric Manager's setup of an HGX board's fabric after a boot takes a minute or two
NO_FABRIC = ("N/A", "Not Supported")


def read_json(path, private=False, owner=None):
    """The JSON object in `path` (never read through a symbolic link), or None when there is none.
    `owner`: the uid of the run's user, whose file it may be (its status.json)."""
    try:
        with os.fdopen(open_file(path, private=private, owner=owner)) as fh:
            data = json.load(fh)
    except FileNotFoundError:
        return None
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def ended_by_itself(status):
    """Why a run whose pidfile outlived it must not start again (it finished or failed), or None."""
    state, reason = status.get("state"), status.get("stop_reason") or ""
    if state == "failed":
        return f"it failed ({status.get('error')}); deploy.yml starts it once that is fixed"
    if state == "stopped" and not reason.startswith("signal"):
        return f"it finished ({reason or 'stopped by itself'})"
    return None


def idle_problems(spec, executable=None):
    """[] once the run's GPUs are idle, else why not when spec's gpu_timeout ran out."""
    gpus = spec.get("gpus") or []
    if not gpus:
        return []
    executable = executable or find_executable()
    if executable is None:
        return ["nvidia-smi is not installed in the container"]
    # In the container nvidia-smi's pids are the node's: nothing to map them to here.
    seen = poll(executable, "idle", gpus, int(spec.get("max_memory_mib", 256)),
                timeout=float(spec.get("gpu_timeout", 120)), interval=GPU_POLL_SECONDS, map_vmids=False)
    return seen["reasons"]


def fabric_states(executable):
    """The GPUs' fabric states that are not Completed ([] when all are, or the board has none). A report
    nvidia-smi cannot give (NVML fails) has no fabric to wait for: the GPU check that follows says why."""
    answer = run(executable, ["-q"])
    if answer.rc != 0:
        return []
    return sorted({f"{state}/{status}" for state, status in parse_fabric(answer.stdout)
                   if state not in NO_FABRIC and state != "Completed"})


def fabric_problem(spec, executable=None):
    """(None, seconds waited) once the GPUs' NVLink fabric is up or there is none; else (what it still is
    when spec's fabric_timeout ran out, seconds waited)."""
    if not spec.get("gpus"):
        return None, 0
    executable = executable or find_executable()
    if executable is None:
        return None, 0  # idle_problems says that nvidia-smi is missing
    started = time.monotonic()
    deadline = started + float(spec.get("fabric_timeout", FABRIC_TIMEOUT))
    while True:
        waiting = fabric_states(executable)
        if waiting == []:
            return None, round(time.monotonic() - started)
        if time.monotonic() >= deadline:
            return ", ".join(waiting), round(time.monotonic() - started)
        time.sleep(FABRIC_POLL_SECONDS)


def outcome(spec, what, msg, **extra):
    return dict(name=spec["name"], outcome=what, msg=msg, **extra,
                time=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def start_params(spec):
    keys = ("name", "pidfile", "log_path", "command", "chdir", "interpreter", "user", "user_reads",
            "output_group", "startup_wait", "wait_for", "wait_timeout")
    return dict({key: spec.get(key) for key in keys}, started_by=STARTED_BY)


def resume(spec, executable=None):
    """Start the run of `spec` again if it was live when its container stopped; the outcome."""
    pidfile = spec["pidfile"]
    with pidfile_lock(pidfile, enabled=True):
        record, verdict, unsafe = inspect(pidfile)
        if unsafe:
            return outcome(spec, "left", f"pidfile {pidfile} {unsafe}: not trusted, nothing started")
        if verdict == "absent":
            return outcome(spec, "stopped", "stopped on purpose (no pidfile): left stopped")
        if verdict == "live":
            return outcome(spec, "running", f"already running: {describe(record)}", pid=record["pid"])
        if verdict == "unreadable":
            return outcome(spec, "left", f"pidfile {pidfile} {record.problem}: left to the operator")
        identity = run_identity(spec.get("user"))
        finished = ended_by_itself(read_json(spec["status_file"], owner=identity and identity["uid"]) or {})
        if finished:
            return outcome(spec, "left", f"not started again: {finished}")
        env = base_environment(spec.get("user"))
        env.update({key: str(value) for key, value in (spec.get("environment") or {}).items()})
        if spec.get("environment_file"):
            env.update(read_environment_file(spec["environment_file"], spec.get("user")))
        params = start_params(spec)
        preflight(params, env)
        fabric, waited = fabric_problem(spec, executable)
        if fabric:
            return outcome(spec, "fabric_not_ready",
                           f"not started: the GPUs' NVLink fabric is {fabric} after {waited}s (nvidia-smi "
                           "-q, Fabric State; CUDA fails with error 802 until it is Completed): on the node, "
                           "systemctl status nvidia-fabricmanager and /var/log/fabricmanager.log say why; "
                           "deploy.yml starts it once the fabric is Completed")
        busy = idle_problems(spec, executable)
        if busy:
            waited = spec.get("gpu_timeout", 120)
            return outcome(spec, "gpus_busy", f"not started: its GPUs are not idle after {waited}s "
                                              f"({'; '.join(busy)}); deploy.yml starts it once they are")
        remove_file(pidfile)  # stale: the run it names died with the container
        new, startup = start_run(params, env)
        after = f", after {waited}s waiting for the GPUs' NVLink fabric to be Completed" if waited else ""
        return outcome(spec, "resumed", f"started again after the container's boot: {describe(new)} (the run "
                                        f"before it, pid {record['pid']}, ended without a stop{after})",
                       pid=new["pid"], previous_pid=record["pid"], progress=startup.get("progress"))


def resume_all(directory, executable=None):
    """Resume every run that has a start file in `directory`; their outcomes, each also written next to
    its pidfile."""
    results = []
    for path in sorted(glob.glob(os.path.join(directory, "*" + START_FILE))):
        name = os.path.basename(path)[: -len(START_FILE)]
        spec = {"name": name}
        try:
            spec = read_json(path, private=True) or spec
            result = resume(spec, executable)
        except (RunError, UnsafePath, NvidiaSmiError, OSError, KeyError) as exc:
            result = outcome(spec, "failed", f"not started: {exc}")
        results.append(result)
        try:
            write_pidfile(os.path.join(directory, name + RESULT_FILE), result)
        except OSError:
            pass  # the outcome is still on stdout (the journal)
    return results
