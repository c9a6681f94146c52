"""Processes by pid: identity through the start time, trees through the parent pid, stopping by pid."""

import os
import signal
import time


def _stat_fields(pid):
    """Fields of /proc/<pid>/stat after the command name (index 0 is the state), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def start_time(pid):
    """The process start time in clock ticks (stat field 22): with the pid, it names one process."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def is_alive(pid, started=None):
    """True for a live (non-zombie) process; with `started`, only if it is still that very process."""
    fields = _stat_fields(pid)
    if not fields or fields[0] in ("Z", "X"):
        return False
    return started is None or int(fields[19]) == started


def children_of():
    """Map parent pid -> child pids over the whole machine."""
    tree = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(entry)
            if fields:
                tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def descendants(pid):
    tree, found, todo = children_of(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_tree(pid, started, grace_s=3.0):
    """SIGTERM a process and everything below it, SIGKILL what outlives the grace period.

    Only acts if `pid` is still the process that started at `started` (a reused pid is left alone).
    """
    if not is_alive(pid, started):
        return
    targets = [(p, start_time(p)) for p in [pid, *descendants(pid)]]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p, st in targets:
            if is_alive(p, st):
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(is_alive(p, st) for p, st in targets):
            time.sleep(0.05)
        if not any(is_alive(p, st) for p, st in targets):
            return
