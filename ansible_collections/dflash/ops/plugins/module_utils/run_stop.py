# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Stopping a run: SIGTERM to its process group and descendants, SIGKILL on timeout, until none is left."""

from __future__ import annotations

import os
import select
import signal
import time

from ansible_collections.dflash.ops.plugins.module_utils.run_pidfile import RunError
from ansible_collections.dflash.ops.plugins.module_utils.run_proc import (
    PROC,
    process_table,
    read_stat,
    run_members,
    self_and_ancestors,
    still_running,
)

POLL_SECONDS = 0.2


def open_pidfd(record, proc_root=PROC):
    """A pidfd of the run's leader, readable once it has exited, or None where there is none to have
    (Linux before 5.3, a fake /proc, a pid that names another process by now: checked after the open,
    which pins the pid, against the start time the pidfile recorded)."""
    if proc_root != PROC or not hasattr(os, "pidfd_open"):
        return None
    try:
        fd = os.pidfd_open(record["pid"])
    except OSError:
        return None
    stat = read_stat(record["pid"], proc_root)
    if stat is None or stat.start_time != record["start_time"]:
        os.close(fd)
        return None
    return fd


def group_is_the_runs(table, record):
    """Whether the recorded process-group id still names the run's group. The id is the leader's
    pid, which the kernel keeps while any member lives; it names another group only if a new
    process now holds that pid."""
    holder = table.get(record["pgid"])
    return holder is None or holder.start_time == record["start_time"]


class RunStopper:
    """Stops one live run: SIGTERM, wait, SIGKILL, wait, confirm that none of its processes is left.

    `tracked` maps every process of the run seen so far to its start time: a snapshot taken before
    signalling (a child that called setsid is a descendant only until its parent dies), grown at
    each poll with new group members and descendants (a helper that finishes the checkpoint)."""

    def __init__(self, record, proc_root=PROC):
        self.record = record
        self.pgid = record["pgid"]
        self.proc_root = proc_root
        self.protected = self_and_ancestors(proc_root)
        self.tracked = run_members(process_table(proc_root), self.pgid, [record["pid"]], self.protected)
        self.signalled = set()
        self.pidfd = None

    def send(self, sig, pids, table):
        """killpg also reaches group members forked since the table was read; escaped descendants
        get their own kill, each re-checked against its start time so a reused pid is never hit."""
        running = still_running(pids, table)
        group_running = any(table[pid].pgid == self.pgid for pid in running)
        shares_group = any(table[pid].pgid == self.pgid for pid in self.protected if pid in table)
        targets = [pid for pid in running if shares_group or table[pid].pgid != self.pgid]
        try:
            if group_running and not shares_group:
                os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        self.signalled.update(running)

    def wait(self, timeout, late_signal):
        """Poll until every tracked process is gone; returns the pids still running at the deadline.
        Processes that appear meanwhile get late_signal if one is given: none while the run shuts
        down on SIGTERM, SIGKILL once it is being killed."""
        deadline = time.monotonic() + timeout
        while True:
            table = process_table(self.proc_root)
            pgid = self.pgid if group_is_the_runs(table, self.record) else None
            found = run_members(table, pgid, still_running(self.tracked, table), self.protected)
            new = {pid: start for pid, start in found.items() if pid not in self.tracked}
            self.tracked.update(new)
            if new and late_signal is not None:
                self.send(late_signal, new, table)
            running = still_running(self.tracked, table)
            if not running or time.monotonic() >= deadline:
                return running
            self.nap(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))

    def nap(self, seconds):
        """Sleep `seconds`, woken as soon as the run's leader exits (its pidfd becomes readable): the end of
        a stop is seen at once, not up to a poll later, and the GPUs' idle check and the successor's start
        follow without that wait. Once it has exited, the rest of the run is polled."""
        if self.pidfd is None:
            time.sleep(seconds)
            return
        readable = select.select([self.pidfd], [], [], seconds)[0]
        if readable:
            os.close(self.pidfd)
            self.pidfd = None

    def stop(self, stop_timeout, kill_timeout, on_kill=None):
        """SIGTERM, then SIGKILL after `stop_timeout` (calling `on_kill` first, to say so)."""
        began = time.monotonic()
        self.pidfd = open_pidfd(self.record, self.proc_root)
        try:
            self.send(signal.SIGTERM, self.tracked, process_table(self.proc_root))
            how = "terminated"
            left = self.wait(stop_timeout, late_signal=None)
            if left:
                how = "killed"
                if on_kill:
                    on_kill()
                self.send(signal.SIGKILL, self.tracked, process_table(self.proc_root))
                left = self.wait(kill_timeout, late_signal=signal.SIGKILL)
        finally:
            if self.pidfd is not None:
                os.close(self.pidfd)
                self.pidfd = None
        summary = dict(seconds=round(time.monotonic() - began, 2), signalled=sorted(self.signalled),
                       processes=sorted(self.tracked))
        if left:
            raise RunError(f"processes {left} of run pid {self.record['pid']} survived SIGKILL for "
                           f"{kill_timeout}s (uninterruptible sleep?); the pidfile is kept", **summary)
        return dict(how=how, **summary)
