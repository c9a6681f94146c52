"""Stubborn runs: stop_training.yml ends a run that ignores SIGTERM, and what it left around.

The run is a stand-in started under the role's name and pidfile (what a deploy would have started),
holding the run's GPUs through CUDA_VISIBLE_DEVICES as the trainer does; its children inherit them.
One container's run ignores SIGTERM and has a child that called setsid (another session, outside
the process group); another's ignores SIGTERM and has a child in its group. After one
stop_training.yml with a short stop timeout, nothing of either is left and the GPUs are idle.
"""

import time

import pytest

from tests.reliability.stops_support import (
    FAKE_RUN,
    LOG,
    PIDFILE,
    RUN_GPUS,
    ensure_runs,
    gpu_memory,
    hosts,
    kill_sessions,
    process_table,
    results_with,
    still_there,
    training_run,
)
from tests.waiting import wait_for

# Under make test-reliability only: a fleet of its own (2 to 3 min); make test keeps the SIGKILL after
# the stop timeout and the group's stragglers through tests/modules/test_training_run_local.py.
pytestmark = [pytest.mark.sim, pytest.mark.slow, pytest.mark.reliability_full]


STOP_TIMEOUT = 3
CASES = {
    201: ("a child in another session", "--escaped-child"),
    202: ("a child in its group", "--group-child"),
}


def start_stubborn_run(fleet, vmid, child_flag):
    """A run under the role's pidfile that ignores SIGTERM, with one child; (record, child pid)."""
    child_file = f"/tmp/stops-stubborn-child-{vmid}"
    fleet.ct(vmid, f"rm -f {child_file}")
    started = training_run(fleet, vmid, name="main", pidfile=PIDFILE, log_path=LOG, state="started",
                           command=["/usr/bin/python3", FAKE_RUN, "--ignore-term", child_flag, child_file],
                           environment={"CUDA_VISIBLE_DEVICES": ",".join(map(str, RUN_GPUS))})
    assert not started.get("failed"), started
    assert wait_for(lambda: (fleet.read(vmid, child_file) or "").strip().isdigit(), timeout=30)
    return started["run"], int(fleet.read(vmid, child_file))


def test_stop_kills_a_run_that_ignores_sigterm_and_leaves_nothing(fleet):
    vmids = sorted(CASES)
    ensure_runs(fleet, vmids, live=False)
    runs, children = {}, {}
    try:
        for vmid, (_, flag) in CASES.items():
            runs[vmid], child = start_stubborn_run(fleet, vmid, flag)
            table = process_table(fleet, vmid)
            children[vmid] = (child, table[child].start_time)
            in_group = table[child].pgid == runs[vmid]["pgid"]
            assert in_group == (flag == "--group-child"), table[child]
            # The run and its child both hold the run's GPUs.
            assert all(gpu_memory(fleet, vmid)[i] >= 2048 for i in RUN_GPUS)

        began = time.monotonic()
        play = fleet.play("stop_training.yml", "-l", hosts(vmids),
                          "-e", f"dflash_run_stop_timeout={STOP_TIMEOUT}",
                          "-e", "dflash_run_kill_timeout=20", timeout=900)
        elapsed = time.monotonic() - began
        assert play.rc == 0, play
        for vmid, (what, _) in CASES.items():
            [stop] = [r for r in results_with(play, f"ct{vmid}", "how") if r.get("how") != "already_stopped"]
            assert stop["how"] == "killed" and stop["seconds"] >= STOP_TIMEOUT, stop
            assert set(stop["signalled"]) >= {runs[vmid]["pid"], children[vmid][0]}, stop
            table = process_table(fleet, vmid)
            left = [p for p in table.values() if p.alive and p.pgid == runs[vmid]["pgid"]]
            assert not left, f"CT {vmid} ({what}): processes of the run's group are left: {left}"
            assert not still_there(table, runs[vmid]["pid"], runs[vmid]["start_time"])
            assert not still_there(table, *children[vmid]), f"CT {vmid}: {what} is left"
            assert fleet.read(vmid, PIDFILE) is None
            memory = gpu_memory(fleet, vmid)
            assert all(memory[i] == 0 for i in RUN_GPUS), f"CT {vmid}: GPUs busy after the stop: {memory}"
            # The playbook's own gpu_verify idle passed for the container.
            assert any(r.get("gpus") is not None and not r.get("failed")
                       for r in results_with(play, f"ct{vmid}", "gpus")), "no gpu_verify result"
            print(f"stubborn run with {what}: killed after {stop['seconds']} s "
                  f"(stop timeout {STOP_TIMEOUT} s), signalled {stop['signalled']}, nothing left, GPUs idle")
        print(f"stubborn runs: stop_training.yml took {elapsed:.0f} s for {len(vmids)} containers")
    finally:
        for vmid, (child, start) in children.items():
            kill_sessions(fleet, vmid, [(child, start)])
        for vmid, run in runs.items():
            kill_sessions(fleet, vmid, [(run["pid"], run["start_time"])])
            fleet.ct(vmid, f"rm -f {PIDFILE}")
