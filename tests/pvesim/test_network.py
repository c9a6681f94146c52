"""The `loopback` network: containers on different nodes reach each other at their own addresses
(their net0 ip); by default (`isolated`) a container reaches nothing outside itself."""

import subprocess

import pytest

from tests.pvesim.simtools import in_ct

pytestmark = pytest.mark.sim

SERVER = """
import socket, sys
with socket.create_server((sys.argv[1], 0)) as server:
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    with conn:
        conn.sendall(socket.gethostname().encode())
"""
CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as conn:
    print(conn.recv(100).decode())
"""


def serve_in(sim, vmid, address):
    """A one-connection server in container `vmid` on `address`; returns (process, port)."""
    node = sim.node_of(vmid).name
    proc = subprocess.Popen([*sim.ssh_argv(node), in_ct(vmid, "python3", "-c", SERVER, address)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())


def connect_from(sim, vmid, address, port):
    return sim.ssh(sim.node_of(vmid).name, in_ct(vmid, "python3", "-c", CLIENT, address, str(port)))


def test_containers_on_two_nodes_reach_each_other_at_their_net0_addresses(sim_factory, sim):
    lan = sim_factory(nodes=2, containers=(300, 301), gpus=0, network="loopback")
    address = lan.address_of(300)
    assert address.startswith("127.") and not address.startswith("127.0.")
    assert address != lan.address_of(301)
    config = lan.ssh("pve1", "pct config 300").stdout
    assert f"net0: name=eth0,bridge=vmbr0,ip={address}/8,type=veth" in config

    server, port = serve_in(lan, 300, address)
    try:
        reply = connect_from(lan, 301, address, port)
        assert reply.returncode == 0, reply.stderr
        assert reply.stdout.strip() == "ct300"  # the container on pve1 answered the one on pve2
        # A container of the default (isolated) sim has a network namespace of its own: that address is
        # on its own loopback, where nothing listens.
        isolated = connect_from(sim, 200, address, port)
        assert isolated.returncode != 0 and "Connection refused" in isolated.stderr
    finally:
        server.kill()
        server.wait()


def test_an_isolated_container_reaches_its_own_loopback_and_resolves_its_hostname(sim):
    # Its init brings lo up, as a Debian template's does: a run's torchrun rendezvouses on 127.0.0.1,
    # and its workers reach the agent's store at the container's hostname (/etc/hosts, as Proxmox writes it).
    lookup = "import socket; print(socket.gethostbyname('ct201'))"
    resolved = sim.ssh("pve1", in_ct(201, "python3", "-c", lookup))
    assert resolved.stdout.strip() == "127.0.1.1", resolved.stderr
    server, port = serve_in(sim, 201, "127.0.0.1")
    try:
        reply = connect_from(sim, 201, "127.0.0.1", port)
        assert reply.returncode == 0, reply.stderr
        assert reply.stdout.strip() == "ct201"
    finally:
        server.kill()
        server.wait()
