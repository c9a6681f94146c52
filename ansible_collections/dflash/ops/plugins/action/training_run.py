# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The controller's half of dflash.ops.training_run: a call that is still under way after
`report_interval` seconds (a stop waiting for the trainer's checkpoint, a start waiting for idle GPUs or
for the run's first training step: up to stop_timeout + idle_timeout + wait_timeout in all) prints one
line per interval with the host, what it waits for and the last line of the run's log, instead of
nothing until it ends. The module's result is returned as the module made it.

The module runs as it always does (one pipelined call, in a thread of this worker); the lines come from a
read of the log over a second channel of the same connection while that call waits. Running the module
through Ansible's async wrapper instead (the `async` keyword's way) works over dflash.ops.pct_pipelined,
but it costs five more round trips into the container for every call (a temporary directory, two files,
their modes, then polls of async_status) — seconds on a loaded node, for a restart that takes a few —
where this costs nothing until a call has waited `report_interval` seconds. A task with the `async`
keyword gets Ansible's async wrapper, and no lines.
"""

from __future__ import annotations

import contextvars
import json
import shlex
import threading
import time
from datetime import UTC, datetime

from ansible.errors import AnsibleError
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display
from ansible.utils.vars import merge_hash

from ansible_collections.dflash.ops.plugins.module_utils.run_pidfile import default_paths, uptime_seconds
from ansible_collections.dflash.ops.plugins.plugin_utils.waits import progress_line

display = Display()

# Seconds between two lines of a call that waits; the module documents it (report_interval).
REPORT_INTERVAL = 30.0
# Separates the parts of the one read a line needs (the log's last line, the pidfile, the target's clock).
SEPARATOR = "\x1e"
# A run whose pidfile says it started at most this many seconds before the call's start, by the
# container's clock, was started by this call (started_at has whole seconds; the clocks are not shared).
CLOCK_SLACK = 2.0


def read_command(log_path, pidfile):
    """The container's /bin/sh command that prints the log's last line, the pidfile and the time (epoch s),
    separated by SEPARATOR; a missing file prints nothing."""
    return (f"tail -n 1 -- {shlex.quote(log_path)} 2>/dev/null; printf '\\036'; "
            f"cat -- {shlex.quote(pidfile)} 2>/dev/null; printf '\\036'; date +%s")


def parse_read(stdout):
    """(last log line, pidfile record or None, the container's time as a UTC datetime or None)."""
    parts = (stdout.split(SEPARATOR) + ["", ""])[:3]
    try:
        record = json.loads(parts[1]) if parts[1].strip() else None
    except ValueError:
        record = None  # written right now, or unreadable: the line just does not name the run
    try:
        now = datetime.fromtimestamp(int(parts[2].strip()), UTC)
    except ValueError:
        now = None
    return parts[0].strip(), record if isinstance(record, dict) else None, now


def seconds(args, key, default):
    """An option's seconds as the line shows them (the module, not this line, judges a bad value)."""
    value = args.get(key, default)
    try:
        return f"{float(value):g} s"
    except (TypeError, ValueError):
        return f"{value!r} s"


def waiting_for(args, record, now, elapsed):
    """What a call `elapsed` seconds under way waits for, from the pidfile it sees now (`record`, or None
    between a stop and a start): the stop of the run that was there before the call, or the run the call
    started, or what comes between."""
    state = args.get("state") or "started"
    age = uptime_seconds(record, now) if record and now else None
    if record and "pid" in record and (state == "stopped" or age is None or age > elapsed + CLOCK_SLACK):
        return (f"the stop of pid {record['pid']} (SIGTERM: its checkpoint; SIGKILL after "
                f"{seconds(args, 'stop_timeout', 120)})")
    if record and "pid" in record:
        if args.get("wait_for"):
            return (f"pid {record['pid']}'s first log line matching {args['wait_for']!r} (at most "
                    f"{seconds(args, 'wait_timeout', 300)})")
        return f"pid {record['pid']} to stay up {seconds(args, 'startup_wait', 1)}"
    if state == "stopped":
        return "the stop to end"
    if args.get("idle_gpus"):
        return f"GPUs {args['idle_gpus']} to be idle, then the start"
    return "the start"


class ActionModule(ActionBase):
    _supports_check_mode = True
    _supports_async = True

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        del tmp  # unused, as in ansible.builtin's normal action
        args = dict(self._task.args)
        interval = args.pop("report_interval", None)
        try:
            interval = REPORT_INTERVAL if interval is None else float(interval)
        except (TypeError, ValueError):
            interval = 0.0
        if interval <= 0:
            given = self._task.args.get("report_interval")
            return dict(result, failed=True,
                        msg=f"report_interval must be a number of seconds > 0, got {given!r}: nothing ran")
        wrap_async = bool(self._task.async_val) and not self._connection.has_native_async
        if wrap_async:
            returned = self._execute_module(module_args=args, task_vars=task_vars, wrap_async=wrap_async)
        else:
            returned = self.execute_reporting(args, task_vars, interval)
        result = merge_hash(result, returned)
        if not wrap_async:
            self._remove_tmp_path(self._connection._shell.tmpdir)
        return result

    def execute_reporting(self, args, task_vars, interval):
        """The module's result; while the call runs, one line every `interval` seconds."""
        outcome = {}

        def call():
            try:
                outcome["result"] = self._execute_module(module_args=args, task_vars=task_vars)
            except BaseException as exc:  # raised again in this worker's own thread, as Ansible expects
                outcome["error"] = exc

        # The module's thread sees the task's context (ansible-core keeps some of it in context variables).
        worker = threading.Thread(target=contextvars.copy_context().run, args=(call,), daemon=True)
        began = time.monotonic()
        worker.start()
        deadline = began + interval
        while True:
            worker.join(max(0.0, deadline - time.monotonic()))
            if not worker.is_alive():
                break
            display.display(self.progress(args, task_vars, time.monotonic() - began))
            deadline += interval
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    def progress(self, args, task_vars, elapsed):
        """The line of a call `elapsed` seconds under way, from one read in the container."""
        host = (task_vars or {}).get("inventory_hostname", "the target")
        pidfile, log_path = default_paths(args.get("name"))
        pidfile, log_path = args.get("pidfile") or pidfile, args.get("log_path") or log_path
        try:
            read = self._low_level_execute_command(read_command(log_path, pidfile), sudoable=True)
            last, record, now = parse_read(read.get("stdout") or "")
        except AnsibleError as exc:  # the module's own call reports a broken connection
            last, record, now = f"(cannot read {log_path}: {exc})", None, None
        # The task's banner may come only with its result (display_skipped_hosts = False): the line names it.
        task = self._task.get_name()
        what = f"{waiting_for(args, record, now, elapsed)} in task {task!r}, {elapsed:.0f} s so far"
        return progress_line(host, last or f"(nothing in {log_path} yet)", waiting_for=what)
