"""Node faults on demand: a node that becomes unreachable, a node whose host key changes, a node
without pct. Each leaves the other node and every container as they were, and each is undone."""

import pytest

from pvesim import container, host, node

pytestmark = pytest.mark.sim


@pytest.fixture
def two_nodes(sim_factory):
    """pve1 with CT 340, pve2 with CT 341."""
    return sim_factory(nodes=2, containers=(340, 341), gpus=1)


def sleeper(s, vmid):
    """Start a process in a container, detached from the ssh session; returns its pid there."""
    res = s.ssh(s.node_of(vmid).name,
                f"pct exec {vmid} -- /bin/sh -c 'setsid sleep 600 >/dev/null 2>&1 < /dev/null & echo $!'")
    assert res.returncode == 0, res.stderr
    return int(res.stdout)


def alive_in(s, vmid, pid):
    return s.ssh(s.node_of(vmid).name, f"pct exec {vmid} -- kill -0 {pid}").returncode == 0


def test_a_stopped_node_refuses_connections_and_its_containers_go_on(two_nodes):
    s = two_nodes
    pid = sleeper(s, 340)
    port = s.node("pve1").port
    s.stop_node("pve1")
    res = s.ssh("pve1", "true", timeout=30)
    assert res.returncode == 255 and "Connection refused" in res.stderr
    assert s.ssh("pve2", "pct status 341").stdout == "status: running\n"
    assert container.state(node.NodeFiles(s.state_dir, "pve1"), 340) == "RUNNING"
    assert '"sshd_pid": null' in (s.state_dir / "sim.json").read_text()

    s.start_node("pve1")
    assert s.node("pve1").port == port
    assert s.ssh("pve1", "pct status 340").stdout == "status: running\n"
    assert alive_in(s, 340, pid)  # what ran in the container outlived the outage
    assert f'"sshd_pid": {s.node("pve1").sshd_pid}' in (s.state_dir / "sim.json").read_text()


def test_a_rotated_host_key_is_refused_until_it_is_trusted(two_nodes):
    s = two_nodes
    old_known_hosts = s.known_hosts.read_text()
    old_system = host.SYSTEM_KNOWN_HOSTS.read_text()
    old_key = node.NodeFiles(s.state_dir, "pve2").host_key_pub.read_text().split()[1]
    s.rotate_host_key("pve2")
    new_key = node.NodeFiles(s.state_dir, "pve2").host_key_pub.read_text().split()[1]
    assert new_key != old_key
    # Nothing trusted the new key: both known_hosts files still hold the old one only.
    assert s.known_hosts.read_text() == old_known_hosts
    assert host.SYSTEM_KNOWN_HOSTS.read_text().count(new_key) == 0 and old_key in old_system
    res = s.ssh("pve2", "true", timeout=30)
    assert res.returncode == 255
    assert "Host key verification failed" in res.stderr or "IDENTIFICATION HAS CHANGED" in res.stderr
    assert s.ssh("pve1", "true").returncode == 0  # the other node keeps its key

    s.trust_host_keys()
    assert new_key in s.known_hosts.read_text() and old_key not in s.known_hosts.read_text()
    assert new_key in host.SYSTEM_KNOWN_HOSTS.read_text()
    assert old_key not in host.SYSTEM_KNOWN_HOSTS.read_text()
    assert s.ssh("pve2", "pct status 341").stdout == "status: running\n"


def test_a_path_hidden_on_a_node_is_gone_there_only(two_nodes):
    s = two_nodes
    s.hide_on_node("pve1", ["/usr/sbin/pct"])
    res = s.ssh("pve1", "test -e /usr/sbin/pct; echo $?; /usr/sbin/pct status 340")
    assert res.returncode == 127 and res.stdout == "1\n" and "No such file or directory" in res.stderr
    # Only pct is gone: the rest of /usr/sbin is there, and the other node still has pct.
    assert s.ssh("pve1", "test -x /usr/sbin/sshd").returncode == 0
    assert s.ssh("pve2", "/usr/sbin/pct status 341").stdout == "status: running\n"
    assert container.state(node.NodeFiles(s.state_dir, "pve1"), 340) == "RUNNING"
    s.hide_on_node("pve1", [])
    assert s.ssh("pve1", "/usr/sbin/pct status 340").stdout == "status: running\n"
