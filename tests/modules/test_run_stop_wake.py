"""A restart's stop sees the run's leader exit at once (its pidfd), not up to a poll of /proc later: the
GPUs' idle check and the successor's start follow without that wait (module_utils/run_stop.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ansible_collections.dflash.ops.plugins.module_utils import run_stop
from ansible_collections.dflash.ops.plugins.module_utils.run_proc import read_stat

# It checkpoints for half a second after SIGTERM, then exits: the stop's first look finds it running.
CHILD = ("import signal, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.5), sys.exit(0)))\n"
         "print('ready', flush=True)\n"
         "time.sleep(600)\n")


@pytest.fixture
def run():
    """A run's leader: a session of its own that exits on SIGTERM; its pidfile record."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        yield proc, {"pid": proc.pid, "pgid": proc.pid, "start_time": read_stat(proc.pid).start_time}
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_the_stop_is_woken_by_the_leader_s_exit_not_by_the_next_poll(run, monkeypatch):
    proc, record = run
    # A poll a minute apart: only the pidfd's wake-up can end this stop in time.
    monkeypatch.setattr(run_stop, "POLL_SECONDS", 60.0)
    started = time.monotonic()
    result = run_stop.RunStopper(record).stop(stop_timeout=120, kill_timeout=10)
    assert result["how"] == "terminated" and result["signalled"] == [proc.pid]
    assert time.monotonic() - started < 30
    assert proc.wait(timeout=30) == 0


def test_no_pidfd_for_a_pid_that_names_another_process_or_a_fake_proc(run, tmp_path):
    _, record = run
    fd = run_stop.open_pidfd(record)
    assert fd is not None
    run_stop.os.close(fd)
    assert run_stop.open_pidfd({**record, "start_time": record["start_time"] + 1}) is None  # pid reused
    assert run_stop.open_pidfd(record, proc_root=str(tmp_path)) is None
