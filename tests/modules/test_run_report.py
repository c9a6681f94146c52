"""run_report reads what status.yml shows of a run in one call: the run's state as training_run judges
its pidfile, the end of its log when it ended without a stop, the live and the running release, its
status.json and its GPUs (an nvidia-smi failure is reported, not failed on)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import UTC, datetime

import pytest
from module_runner import Run, alive, run_module
from test_gpu_verify_local import BUSY, FakeNvidiaSmi

from tests.waiting import wait_for


def report(run, smi, tmp_path, **extra):
    args = dict(name=run.name, pidfile=str(run.pidfile), log_path=str(run.log), root=str(tmp_path / "opt"),
                output_dir=str(tmp_path / "out"), **extra)
    result, rc = run_module("run_report", args, env=smi.env)
    assert rc == 0 and result["changed"] is False, result
    return result


def test_a_running_run_with_its_releases_progress_and_gpus(tmp_path, processes):
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    smi.answer(BUSY)
    release = tmp_path / "opt" / "releases" / "abc123"
    release.mkdir(parents=True)
    os.symlink(release, tmp_path / "opt" / "current")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "status.json").write_text(json.dumps({"state": "running", "step": 7}))
    started = run.start()
    # The run's program lives in another release: a restart is due.
    record = json.loads(run.pidfile.read_text())
    record["argv"] = ["/opt/dflash/releases/old999/run.sh"]
    run.pidfile.write_text(json.dumps(record))
    shown = report(run, smi, tmp_path, gpus=[0, 1])
    assert (shown["state"], shown["pid"], shown["ended"]) == ("running", started["pid"], False)
    assert (shown["release"], shown["running_release"]) == ("abc123", "old999")
    assert shown["progress"] == {"state": "running", "step": 7} and shown["log_tail"] == ""
    assert [g["memory_used_mib"] for g in shown["gpus"]] == [61234, 4] and shown["gpu_error"] == ""


def test_a_run_that_ended_without_a_stop_shows_its_log_and_nothing_live(tmp_path, processes):
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    # The run ends by itself, with no stop (killed here, as a crash would end it): once it is gone, its
    # log is the test's alone. (A run that exits at once raced both the start's own check and the
    # test's write of the log: `make test-flaky` showed 15 to 20 % failures under load.)
    started = run.start()
    os.kill(started["pid"], signal.SIGKILL)
    assert wait_for(lambda: not alive(started["pid"]), timeout=60), "the fake run outlived SIGKILL"
    run.log.write_text("step 1\nthe error\n")
    shown = report(run, smi, tmp_path)
    assert (shown["state"], shown["pid"], shown["ended"]) == ("stopped", None, True), shown
    assert shown["log_tail"].endswith("the error\n") and shown["release"] == "-"
    # The release the run came from: the directory of its program (here the Python that ran it).
    assert shown["running_release"] == os.path.basename(os.path.dirname(sys.executable))
    assert (shown["progress"], shown["gpus"], shown["gpu_error"]) == ({}, [], "")


def test_no_pidfile_and_gpus_that_cannot_be_read(tmp_path, processes):
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    smi.answer({"gpus": "", "stderr": "NVIDIA-SMI has failed because it couldn't communicate with the "
                "NVIDIA driver.", "rc": 9})
    shown = report(run, smi, tmp_path, gpus=[0])
    assert (shown["state"], shown["ended"], shown["running_release"]) == ("stopped", False, "-")
    assert shown["gpus"] == [] and "cannot reach the NVIDIA driver" in shown["gpu_error"], shown


def test_status_json_and_the_boot_result_are_read_but_never_through_a_link(tmp_path, processes):
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    started = run.start()
    record = json.loads(run.pidfile.read_text())
    record["started_by"] = "boot"
    run.pidfile.write_text(json.dumps(record))
    boot = run.pidfile.parent / f"{run.name}.boot-result.json"
    boot.write_text(json.dumps({"outcome": "started", "msg": "resumed"}))
    (tmp_path / "out").mkdir()
    secret = tmp_path / "elsewhere.json"
    secret.write_text(json.dumps({"state": "running", "step": 99}))
    os.symlink(secret, tmp_path / "out" / "status.json")
    shown = report(run, smi, tmp_path)
    assert (shown["pid"], shown["started_by"]) == (started["pid"], "boot") and shown["started_at"]
    assert shown["boot"] == {"outcome": "started", "msg": "resumed"}
    assert shown["progress"] == {}, shown  # the link's target is not read


def test_a_job_running_beside_the_run_is_reported_with_its_last_log_line(tmp_path, processes):
    """A regeneration started like a run (its pidfile and log beside the run's): status.yml shows it while
    it runs, with how far it got, and not once it stopped."""
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    job = Run(tmp_path, processes, name="regenerate")
    (tmp_path / "out").mkdir()
    run.start()
    assert report(run, smi, tmp_path)["jobs"] == []
    started = job.start()
    assert wait_for(lambda: job.log.exists() and job.log.read_text().strip())
    last = job.log.read_text().strip().splitlines()[-1]
    (shown,) = report(run, smi, tmp_path)["jobs"]
    assert (shown["name"], shown["pid"]) == ("regenerate", started["pid"]) and shown["last"]
    assert shown["last"] in job.log.read_text() and last
    stopped, rc = job.call(state="stopped")
    assert rc == 0, stopped
    assert report(run, smi, tmp_path)["jobs"] == []


def at(seconds_ago):
    """An ISO 8601 time `seconds_ago` seconds before now, as status.json and the pidfile write it."""
    return datetime.fromtimestamp(time.time() - seconds_ago, UTC).isoformat(timespec="seconds")


@pytest.mark.parametrize(("written", "updated_ago", "live", "stalled"), [
    ("running", 600, True, True),       # live, `running`, no step for 10 minutes: stalled
    ("running", 30, True, False),       # a step within the window
    ("starting", 600, True, False),     # still loading its models: no step is due yet
    ("stopping", 600, True, False),     # its stop is under way
    ("running", 7200, True, False),     # the previous run's status.json: this run is still starting
    ("running", 600, False, False),     # gone: it died (the table says so), not stalled
])
def test_a_live_run_without_a_step_for_longer_than_the_window_is_stalled(
        tmp_path, processes, written, updated_ago, live, stalled):
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    started = run.start()
    record = json.loads(run.pidfile.read_text())
    record["started_at"] = at(3600)  # the run started an hour ago
    run.pidfile.write_text(json.dumps(record))
    if not live:
        os.kill(started["pid"], signal.SIGKILL)
        assert wait_for(lambda: not alive(started["pid"]), timeout=60), "the fake run outlived SIGKILL"
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "status.json").write_text(
        json.dumps({"state": written, "step": 7, "updated_at": at(updated_ago)}))
    shown = report(run, smi, tmp_path, stalled_after=300)
    assert shown["stalled"] is stalled, shown
    assert updated_ago <= shown["step_age"] <= updated_ago + 60, shown  # by the container's clock


def test_the_step_age_of_a_status_json_without_a_time(tmp_path, processes):
    smi, run = FakeNvidiaSmi(tmp_path), Run(tmp_path, processes)
    run.start()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "status.json").write_text(json.dumps({"state": "running", "step": 7}))
    shown = report(run, smi, tmp_path, stalled_after=0)
    assert (shown["step_age"], shown["stalled"]) == (None, False), shown
