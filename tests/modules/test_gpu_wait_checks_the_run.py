"""A GPU wait that names the run it expects (run_pidfile, run_expect_pid) fails at once, with the
"another deploy" message naming the run that now holds the pidfile, instead of waiting out its timeout
for GPUs that another deploy's run holds (two restarts at once)."""

from __future__ import annotations

import fcntl
import os

from module_runner import Run
from test_gpu_verify_local import BUSY, IDLE, FakeNvidiaSmi

CHANGED = "another deploy (or an operator) changed it meanwhile"


def wait_idle(smi, run, expect_pid, timeout=30):
    return smi.verify(expect="idle", timeout=timeout, interval=0.2, run_pidfile=str(run.pidfile),
                      run_name=run.name, run_expect_pid=expect_pid)


def test_a_run_started_by_another_deploy_fails_the_idle_wait_at_once(tmp_path, processes):
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    smi.answer(BUSY)
    started = run.start()
    result, rc = wait_idle(smi, run, expect_pid=0)
    assert rc != 0 and result["polls"] == 0, result
    assert CHANGED in result["msg"] and f"pid {started['pid']}" in result["msg"], result["msg"]
    assert "expected no run" in result["msg"] and "Stopped waiting for the GPUs" in result["msg"]
    # The run that holds the pidfile is returned as data, its release (argv) included.
    assert result["pid"] == started["pid"] and result["run"]["argv"] == started["run"]["argv"]


def test_the_run_this_play_started_passes_the_check_and_the_wait_goes_on(tmp_path, processes):
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    smi.answer(BUSY)
    started = run.start()
    result, rc = smi.verify(expect="busy", gpus=[0], timeout=5, run_pidfile=str(run.pidfile),
                            run_name=run.name, run_expect_pid=started["pid"])
    assert rc == 0 and result["met"], result


def test_no_run_and_no_pidfile_is_what_the_idle_wait_after_a_stop_expects(tmp_path, processes):
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    smi.answer(IDLE)
    result, rc = wait_idle(smi, run, expect_pid=0)
    assert rc == 0 and result["met"], result


def test_a_run_stopped_by_another_deploy_fails_the_busy_wait_at_once(tmp_path, processes):
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    smi.answer(IDLE)
    started = run.start()
    assert run.call(state="stopped")[1] == 0
    result, rc = smi.verify(expect="busy", timeout=30, run_pidfile=str(run.pidfile), run_name=run.name,
                            run_expect_pid=started["pid"])
    assert rc != 0 and result["polls"] == 0, result
    assert "is gone" in result["msg"] and CHANGED in result["msg"], result["msg"]


def test_a_deploy_changing_the_run_right_now_fails_the_wait_at_once(tmp_path, processes):
    """The lock training_run holds while it stops or starts the run: never waited for by a GPU wait."""
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    smi.answer(IDLE)
    run.start()
    assert run.call(state="stopped")[1] == 0
    lock_fd = os.open(f"{run.pidfile}.lock", os.O_RDWR)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        result, rc = wait_idle(smi, run, expect_pid=0)
    finally:
        os.close(lock_fd)
    assert rc != 0 and result["polls"] == 0, result
    assert "is being changed by another deploy" in result["msg"] and f"{run.pidfile}.lock" in result["msg"]
