"""training_run's free_ports and its `checked` state, run for real on this machine against listeners the
tests start themselves: a start is refused before anything is stopped when another process listens on
a port the run needs (torch's TCPStore binds the wildcard, so a listener on any address blocks it); the
run the start replaces may hold it."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from module_runner import FAKE_RUN

from ansible_collections.dflash.ops.plugins.module_utils.run_ports import port_refusal
from tests.waiting import wait_for

# Listens on (ADDRESS, 0), prints its port, then sleeps until killed. "::" is a dual-stack wildcard, as
# TCPStore's is.
LISTENER = """
import socket, sys, time
family = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
s = socket.socket(family)
if family == socket.AF_INET6:
    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
s.bind((sys.argv[1], 0))
s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(600)
"""


def ipv6():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def listen(processes, address):
    """A process of the test's listening on `address`; returns (pid, port)."""
    proc = processes.spawn([sys.executable, "-c", LISTENER, address], stdout=subprocess.PIPE, text=True)
    return proc.pid, int(proc.stdout.readline())


@pytest.mark.parametrize("address", ["127.0.0.1", "::"])
def test_a_port_another_process_listens_on_refuses_the_start_before_anything_is_stopped(run, processes,
                                                                                          address):
    if address == "::" and not ipv6():
        pytest.skip("no IPv6 on this machine")
    first = run.start()
    holder, port = listen(processes, address)
    for state in ("checked", "restarted"):
        result, rc = run.call(state=state, command=[sys.executable, FAKE_RUN], free_ports=[port])
        assert rc != 0, result
        assert f"port {port}" in result["msg"] and "this call stopped nothing" in result["msg"], result
        assert f"pid {holder} ({sys.executable} -c" in result["msg"], result
        # The run it would have replaced runs on.
        status, _ = run.call(state="status")
        assert status["status"] == "running" and status["pid"] == first["pid"]


def test_the_run_a_start_replaces_may_hold_the_port_and_a_check_changes_nothing(run):
    result, rc = run.call(command=[sys.executable, "-c", LISTENER, "127.0.0.1"])
    assert rc == 0, result
    assert wait_for(lambda: run.log.read_text().strip(), timeout=30), "the run never printed its port"
    port = int(run.log.read_text().split()[0])

    checked, rc = run.call(state="checked", command=[sys.executable, FAKE_RUN], free_ports=[port])
    assert rc == 0, checked
    assert checked["changed"] is False and f"would stop pid {result['pid']}" in checked["msg"]
    status, _ = run.call(state="status")
    assert status["pid"] == result["pid"]  # nothing stopped, nothing started

    restarted, rc = run.call(state="restarted", command=[sys.executable, FAKE_RUN], free_ports=[port])
    assert rc == 0, restarted
    assert restarted["previous_pid"] == result["pid"] and restarted["pid"] != result["pid"]


def test_a_checked_start_with_nothing_running_creates_nothing(run):
    result, rc = run.call(state="checked", command=[sys.executable, FAKE_RUN], free_ports=[1])
    assert rc == 0, result
    assert result["changed"] is False and not run.pidfile.exists() and not run.log.exists()


def test_a_checked_start_runs_the_starts_checks(run, tmp_path):
    missing = tmp_path / "no-such-program"
    result, rc = run.call(state="checked", command=[str(missing)])
    assert rc != 0 and "is not an executable file" in result["msg"], result


def test_bad_ports_are_refused(run):
    result, rc = run.call(state="checked", command=[sys.executable, FAKE_RUN], free_ports=[0])
    assert rc != 0 and "free_ports must be TCP ports" in result["msg"], result


def test_a_listener_no_process_in_view_holds_is_refused(tmp_path):
    """Another container sharing the network namespace: /proc/net/tcp shows its listener, and no process
    of this container's /proc holds the socket."""
    (tmp_path / "net").mkdir()
    header = "sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode\n"
    listener = "0: 0100007F:7149 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 4242 1\n"
    (tmp_path / "net" / "tcp").write_text(header + listener)
    (tmp_path / "1" / "fd").mkdir(parents=True)
    (tmp_path / "1" / "fd" / "3").symlink_to("socket:[999]")
    refusal = port_refusal([0x7149], {}, proc_root=str(tmp_path))
    assert refusal and "port 29001" in refusal and "no process of this container holds" in refusal
    assert port_refusal([29002], {}, proc_root=str(tmp_path)) is None
