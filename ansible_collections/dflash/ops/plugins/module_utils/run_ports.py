# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Who listens on a TCP port, from /proc (pure functions: proc_root is a parameter so tests can hand
them a fake tree).

A run across containers hosts torchrun's rendezvous store on its first member, and torch's TCPStore
listens on every address of the container (the wildcard), so any listener on that port, whatever its
address, makes the store's bind fail with EADDRINUSE. The start checks the port before the run it
replaces is stopped."""

from __future__ import annotations

import os

from ansible_collections.dflash.ops.plugins.module_utils.run_proc import PROC

LISTEN = "0A"  # the kernel's TCP_LISTEN in /proc/net/tcp's `st` column (include/net/tcp_states.h)


def listening_inodes(port, proc_root=PROC):
    """The socket inodes of TCP listeners on `port`, any address, IPv4 and IPv6 (the network namespace's
    /proc/net/tcp and tcp6: `local_address` is ADDR:PORT in hex, `st` the state, the 10th column the
    inode)."""
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc_root}/net/{table}") as handle:
                lines = handle.read().splitlines()[1:]
        except OSError:  # no IPv6 in this kernel
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != LISTEN:
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def socket_holders(inodes, proc_root=PROC):
    """pid -> command line of the processes with one of the socket `inodes` open."""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    holders = {}
    for entry in os.listdir(proc_root):
        if not entry.isdigit():
            continue
        fd_dir = f"{proc_root}/{entry}/fd"
        try:
            links = [os.readlink(f"{fd_dir}/{fd}") for fd in os.listdir(fd_dir)]
        except OSError:  # gone, or a process this one may not look into
            continue
        if wanted.intersection(links):
            holders[int(entry)] = command_line(int(entry), proc_root)
    return holders


def command_line(pid, proc_root=PROC):
    """What a refusal names the holder by; no process is chosen or signalled by its command line."""
    try:
        with open(f"{proc_root}/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def port_refusal(ports, run_pids, proc_root=PROC):
    """Why the run cannot listen on one of `ports`, as the refusal message, or None: a process that is not
    one of `run_pids` (the run the start replaces) listens on it, or a listener whose process this
    container cannot see (another container sharing its network)."""
    for port in ports:
        inodes = listening_inodes(port, proc_root)
        if not inodes:
            continue
        holders = socket_holders(inodes, proc_root)
        foreign = {pid: cmd for pid, cmd in holders.items() if pid not in run_pids}
        if foreign:
            named = "; ".join(f"pid {pid} ({cmd or '?'})" for pid, cmd in sorted(foreign.items()))
            return (f"port {port}, which the run listens on (the rendezvous of a run across containers), is "
                    f"held by another process: {named}. The run could not start, and this call stopped "
                    f"nothing: stop that process or choose another dflash_run_rendezvous_port")
        if not holders:
            return (f"port {port}, which the run listens on (the rendezvous of a run across containers), has "
                    f"a listener no process of this container holds (another container in its network "
                    f"namespace?). The run could not start, and this call stopped nothing")
    return None
