# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""/proc readers for the run modules: pure functions (proc_root is a parameter so tests can hand them
a fake tree). Processes are chosen by pid, process group and start time, never by name."""

from __future__ import annotations

import os
from collections import defaultdict
from typing import NamedTuple

PROC = "/proc"


class ProcStat(NamedTuple):
    state: str
    ppid: int
    pgid: int
    start_time: int


def parse_stat(text):
    """The fields of /proc/<pid>/stat we use. Field 2 (the command name) may contain spaces and
    ')', so fields are counted from the last ')': field N is at index N - 3 after it."""
    rparen = text.rfind(")")
    if rparen < 0:
        return None
    fields = text[rparen + 1 :].split()
    if len(fields) < 20:
        return None
    try:
        return ProcStat(fields[0], int(fields[1]), int(fields[2]), int(fields[19]))
    except ValueError:
        return None


def read_stat(pid, proc_root=PROC):
    try:
        with open(f"{proc_root}/{pid}/stat") as stat_file:
            return parse_stat(stat_file.read())
    except OSError:  # gone between listing and reading, or never there
        return None


def process_table(proc_root=PROC):
    table = {}
    for entry in os.listdir(proc_root):
        if entry.isdigit():
            stat = read_stat(int(entry), proc_root)
            if stat is not None:
                table[int(entry)] = stat
    return table


def is_alive(stat):
    """Zombies (Z) and dead tasks (X) count as gone: they run nothing and hold no GPU."""
    return stat is not None and stat.state not in ("Z", "X", "x")


def self_and_ancestors(proc_root=PROC):
    """This module and the processes above it (the shell, pct exec, sshd...): never signalled,
    even if a run were started from within them."""
    protected, pid = set(), os.getpid()
    while pid > 1 and pid not in protected:
        protected.add(pid)
        stat = read_stat(pid, proc_root)
        pid = stat.ppid if stat else 0
    return protected


def run_members(table, pgid, roots, protected=frozenset()):
    """Live processes of the run, pid -> start time: the process group plus every descendant of
    the roots. A child that called setsid has left the group but is still a descendant until its
    parent dies, which is why callers snapshot before signalling and keep what they saw."""
    members = {pid: st.start_time for pid, st in table.items() if st.pgid == pgid and is_alive(st)}
    children = defaultdict(list)
    for pid, st in table.items():
        children[st.ppid].append(pid)
    pending = [pid for pid in roots if is_alive(table.get(pid))] + list(members)
    seen = set()
    while pending:
        pid = pending.pop()
        if pid in seen:
            continue
        seen.add(pid)
        for child in children.get(pid, ()):
            if is_alive(table[child]):
                members[child] = table[child].start_time
                pending.append(child)
    return {pid: start for pid, start in members.items() if pid not in protected}


def still_running(tracked, table):
    """Tracked pids that still run with the start time they had when first seen."""
    return sorted(pid for pid, start in tracked.items()
                  if is_alive(table.get(pid)) and table[pid].start_time == start)
