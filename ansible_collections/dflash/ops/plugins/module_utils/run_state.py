# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What training_run does for each state, under the pidfile's lock: read the run's status, stop what the
pidfile names (a stale pidfile is removed or set aside, nothing signalled), start the run, after a
restart's stop and a wait for its GPUs to be idle, or only check that a start would pass (checked)."""

from __future__ import annotations

from ansible_collections.dflash.ops.plugins.module_utils import run_job
from ansible_collections.dflash.ops.plugins.module_utils.gpu_state import poll, unmet_message
from ansible_collections.dflash.ops.plugins.module_utils.nvidia_smi import NvidiaSmiError, find_executable
from ansible_collections.dflash.ops.plugins.module_utils.run_pidfile import (
    RunError,
    check_expected,
    describe,
    inspect,
    remove_file,
    running_result,
    set_aside,
    stopped_result,
)
from ansible_collections.dflash.ops.plugins.module_utils.run_ports import port_refusal
from ansible_collections.dflash.ops.plugins.module_utils.run_proc import process_table, run_members
from ansible_collections.dflash.ops.plugins.module_utils.run_start import (
    last_log_line,
    log_match,
    log_refusal,
    log_tail,
    own_directories,
    preflight,
    remove_private_file,
    run_identity,
    start_run,
)
from ansible_collections.dflash.ops.plugins.module_utils.run_stop import RunStopper

# Seconds between the reads of nvidia-smi while the start waits for idle GPUs.
IDLE_POLL_SECONDS = 0.5


def do_stop(module, record, verdict, phases):
    """Stop what the pidfile names; returns the result fields."""
    params = module.params
    pidfile = params["pidfile"]
    if verdict == "absent":
        return dict(changed=False, how="already_stopped", seconds=0.0, signalled=[], processes=[], pid=None,
                    msg=f"no pidfile {pidfile}: nothing to stop")
    if verdict == "unreadable":
        aside = None if module.check_mode else set_aside(pidfile)
        return dict(changed=True, how="stale_pidfile", seconds=0.0, signalled=[], processes=[], pid=None,
                    pidfile_problem=record.problem, set_aside=aside,
                    msg=f"stale pidfile {pidfile}: {describe(record)}; nothing signalled, kept as {aside}")
    if verdict != "live":
        msg = f"stale pidfile {pidfile} ({verdict}: {describe(record)}) removed, nothing signalled"
        if not module.check_mode:
            remove_file(pidfile)
        return dict(changed=True, how="stale_pidfile", seconds=0.0, signalled=[], processes=[],
                    pid=record["pid"], msg=msg)
    if module.check_mode:
        return dict(changed=True, pid=record["pid"], msg=f"would stop {describe(record)}")
    phases.set(run_job.stop_phase(record["pid"], params["stop_timeout"]))
    killing = run_job.kill_phase(record["pid"], params["kill_timeout"])
    stopped = RunStopper(record).stop(params["stop_timeout"], params["kill_timeout"],
                                      on_kill=lambda: phases.set(killing))
    remove_file(pidfile)
    return dict(changed=True, pid=record["pid"], msg=f"stopped {describe(record)}: {stopped['how']}",
                **stopped)


def wait_idle_gpus(params, executable):
    """Wait until the GPUs the run will use are idle; returns what the wait saw. Raises RunError (nothing
    started) when they stay busy or nvidia-smi fails. Runs under the pidfile's lock."""
    try:
        seen = poll(executable, "idle", params["idle_gpus"], params["idle_max_memory_mib"],
                    timeout=params["idle_timeout"], interval=IDLE_POLL_SECONDS)
    except NvidiaSmiError as exc:
        raise RunError(f"cannot check that GPUs {params['idle_gpus']} are idle, so the run was not "
                       f"started: {exc}") from None
    if not seen["met"]:
        raise RunError(f"GPUs {params['idle_gpus']} are not idle, so the run was not started: "
                       f"{unmet_message('idle', seen)}", gpu_idle=seen)
    return seen


def apply_state(module, env, phases):
    """Does what params["state"] asks (read, stop, start or restart the run) and returns the result fields;
    `env` is a start's environment, and each phase of a change is written to `phases`. Raises RunError,
    with the result fields so far, when it refuses or fails."""
    params = module.params
    state = params["state"]
    record, verdict, unsafe = inspect(params["pidfile"])

    if state == "status":
        extra = {key: value for key, value in (("pidfile_unsafe", unsafe),
                                               ("log_unsafe", log_refusal(params["log_path"]))) if value}
        if verdict == "live":
            found = None
            if params["wait_for"] and params["log_offset"] is not None:
                found = log_match(params["log_path"], params["log_offset"], params["wait_for"])
                extra["matched"] = found is not None
            if params["log_path"]:
                extra["progress"] = found or last_log_line(params["log_path"])
            return running_result(record, changed=False, msg=f"running: {describe(record)}", **extra)
        if verdict not in ("absent", "live"):  # it ended without a stop: finished, failed or died
            extra["log_tail"] = log_tail(params["log_path"])
        return stopped_result(record, verdict, changed=False, msg=f"stopped ({verdict} pidfile)", **extra)

    if unsafe:
        raise RunError(f"pidfile {params['pidfile']} {unsafe}: anyone able to write it could name any "
                       f"process, so it is not trusted and nothing was signalled or started. Check who "
                       f"changed it, then make it root-owned and not writable by others (chmod 0644) or "
                       f"remove it.", pidfile_unsafe=unsafe)
    check_expected(params["name"], params["pidfile"], params["expect_pid"], record, verdict,
                   "Nothing was signalled or started")

    if state == "stopped":
        result = stopped_result(record, verdict)
        result.update(do_stop(module, record, verdict, phases))
        return result

    preflight(params, env)
    executable = None
    if params["idle_gpus"]:
        executable = find_executable()
        if executable is None:
            raise RunError(f"idle_gpus {params['idle_gpus']} are checked with nvidia-smi, which is not found "
                           f"(PATH={env.get('PATH')}): nothing was signalled or started")
    if state == "started" and verdict == "live":
        if record.get("argv") == params["command"] and record.get("user") == params["user"]:
            return running_result(record, changed=False, msg=f"already running: {describe(record)}")
        raise RunError(f"pidfile {params['pidfile']} is held by a live run with another command or user: "
                       f"{describe(record)}; use state=restarted to replace it", **running_result(record))
    if params["free_ports"]:
        # The run this start replaces may hold them: it is stopped first.
        run_pids = run_members(process_table(), record["pgid"], [record["pid"]]) if verdict == "live" else {}
        refused = port_refusal(params["free_ports"], run_pids)
        if refused:
            raise RunError(refused)
    if state == "checked":
        replaces = f"; it would stop {describe(record)} first" if verdict == "live" else ""
        return dict(changed=False, msg=f"a start of {params['command']} passes its checks{replaces}")
    result = {}
    if verdict != "absent":  # restarted with a live run, or any stale pidfile
        result.update(do_stop(module, record, verdict, phases))
        result["previous_pid"] = result.pop("pid")
        result["stop_msg"] = result.pop("msg")
    if module.check_mode:
        result.update(stopped_result(record, verdict, changed=True, msg=f"would start {params['command']}"))
        return result
    if executable:
        phases.set(run_job.gpus_phase(params["idle_gpus"], params["idle_timeout"]))
        try:
            result["gpu_idle"] = wait_idle_gpus(params, executable)
        except RunError as exc:
            exc.result.update(result, **stopped_result(record, verdict))
            raise
    identity = run_identity(params["user"])
    if identity and params["user_directories"]:
        result["user_directories"] = own_directories(params["user_directories"], identity)
    if params["stale_environment_file"] and remove_private_file(params["stale_environment_file"]):
        result["removed_environment_file"] = params["stale_environment_file"]
    phases.set(run_job.start_phase(params["wait_for"]))
    new_record, startup = start_run(params, env)
    msg = f"started {describe(new_record)}"
    if "stop_msg" in result:
        msg = f"{result['stop_msg']}; {msg}"
    result.update(running_result(new_record, changed=True, msg=msg, **startup))
    result["stale_pidfile"] = verdict not in ("absent", "live")
    return result
