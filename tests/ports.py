"""A port for a torch c10d store in the tests.

A torch c10d store (torchrun's rendezvous) listens on every address of the machine: TCPStore binds the
wildcard (`ss -ltn` shows `*:PORT`), whatever address its endpoint names. The sim's `loopback` network
shares the machine's network namespace, so a member's store needs its port free on the whole machine,
and an outgoing connection that takes that port as its ephemeral source port makes the store's bind fail
with EADDRINUSE. `rendezvous_port` picks one below the kernel's ephemeral range.
"""

import hashlib
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # above the well-known and the common registered services' ports


def free_on_every_address(port: int) -> bool:
    """Whether a listener could bind `port` on the wildcard now (no listener, no connection holds it)."""
    # TCPStore's wildcard is IPv6's "::" taking IPv4 too where the machine has IPv6, else IPv4's.
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "")):
        try:
            s = socket.socket(family)
        except OSError:  # no IPv6 here
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore: TIME_WAIT is no conflict
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                s.bind((address, port))
            except OSError:
                return False
        return True
    return False


def rendezvous_port(seed: str) -> int:
    """A port for a c10d store that stays usable while a test's runs stop and start on it: below the
    ephemeral range (no outgoing connection is given it) and free on every address now. `seed` (a sim's
    tag) spreads sims side by side over the range."""
    ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    span = ephemeral_low - LOWEST
    if span <= 0:
        raise RuntimeError(f"the ephemeral port range starts at {ephemeral_low}, below {LOWEST}")
    start = int(hashlib.sha1(seed.encode()).hexdigest(), 16) % span
    for i in range(span):
        port = LOWEST + (start + i) % span
        if free_on_every_address(port):
            return port
    raise RuntimeError(f"no free port in {LOWEST}-{ephemeral_low - 1}")
