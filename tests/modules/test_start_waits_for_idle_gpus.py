"""A start that checks the run's GPUs idle itself (idle_gpus): in the same call as the start, under the
pidfile's lock, after the stop of a restart; busy GPUs start nothing, and a missing nvidia-smi stops
nothing."""

from __future__ import annotations

import sys

from module_runner import FAKE_RUN, Run, alive, run_module
from test_gpu_verify_local import BUSY, IDLE, FakeNvidiaSmi


def call(run, smi, **extra):
    result, rc = run_module("training_run", run.args(**extra), env=smi.env)
    if rc == 0 and result.get("status") == "running":
        run.processes.track(result["pid"])
    return result, rc


def test_the_start_waits_until_the_gpus_are_idle_then_starts(tmp_path, processes):
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    smi.answer(BUSY, BUSY, IDLE)  # GPU 0 holds memory for two reads, then is free
    result, rc = call(run, smi, command=[sys.executable, FAKE_RUN], idle_gpus=[0], idle_timeout=20)
    assert rc == 0 and result["status"] == "running", result
    assert result["gpu_idle"]["met"] and result["gpu_idle"]["polls"] == 3 and smi.calls() == 3, result
    assert alive(result["pid"])


def test_gpus_that_stay_busy_start_nothing_and_say_what_holds_them(tmp_path, processes):
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    smi.answer(BUSY)
    result, rc = call(run, smi, command=[sys.executable, FAKE_RUN], idle_gpus=[0, 1], idle_timeout=1)
    assert rc != 0 and result["status"] == "stopped" and not run.pidfile.exists(), result
    assert "GPUs [0, 1] are not idle, so the run was not started" in result["msg"], result["msg"]
    assert "GPU 0 is busy: 1 compute process(es) [81234]" in result["msg"]
    # It waited the whole idle_timeout (polls: as many as fit in it, one on a loaded machine).
    assert result["gpu_idle"]["seconds"] >= 1 and result["gpu_idle"]["polls"] >= 1, result["gpu_idle"]
    assert not result["gpu_idle"]["met"]


def test_a_restart_stops_checks_the_gpus_and_starts_in_one_call(tmp_path, processes):
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    smi.answer(IDLE)
    old = run.start()
    new, rc = call(run, smi, command=[sys.executable, FAKE_RUN, "--step-after", "0"], state="restarted",
                   expect_pid=old["pid"], idle_gpus=[0, 1], idle_timeout=10)
    assert rc == 0 and new["previous_pid"] == old["pid"] and new["how"] == "terminated", new
    assert new["gpu_idle"]["met"] and new["pid"] != old["pid"] and not alive(old["pid"])
    # A second restart that still expects the first run is another deploy's: it changes nothing.
    late, rc = call(run, smi, command=[sys.executable, FAKE_RUN, "--step-after", "1"], state="restarted",
                    expect_pid=old["pid"], idle_gpus=[0, 1])
    assert rc != 0 and "another deploy" in late["msg"] and alive(new["pid"]), late


def test_a_restart_whose_gpus_stay_busy_leaves_the_run_stopped_and_says_so(tmp_path, processes):
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    smi.answer(BUSY)
    old = run.start()
    result, rc = call(run, smi, command=[sys.executable, FAKE_RUN], state="restarted", expect_pid=old["pid"],
                      idle_gpus=[0], idle_timeout=1)
    assert rc != 0 and result["previous_pid"] == old["pid"] and result["how"] == "terminated", result
    assert "not idle, so the run was not started" in result["msg"] and not run.pidfile.exists()
    assert not alive(old["pid"])


def test_without_nvidia_smi_a_restart_stops_nothing(tmp_path, processes):
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    old = run.start()
    env = dict(smi.env, PATH="/nonexistent")
    result, rc = run_module("training_run", run.args(command=[sys.executable, FAKE_RUN], state="restarted",
                                                     idle_gpus=[0]), env=env)
    assert rc != 0 and "nvidia-smi, which is not found" in result["msg"], result
    assert "nothing was signalled or started" in result["msg"] and alive(old["pid"])
