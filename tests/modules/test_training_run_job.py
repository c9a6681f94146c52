"""A start's call as an Ansible async job and the status call that waits for it (module_utils/run_job):
the job file read as async_status reads it, the call's result handed back as the call made it, the phase
file the call keeps under the run's lock, and the wait that returns as soon as the job ends."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from module_runner import FAKE_RUN, REPO, VENV_BIN, alive, run_module

from ansible_collections.dflash.ops.plugins.module_utils import run_job
from ansible_collections.dflash.ops.plugins.module_utils.run_pidfile import RunError

STARTED = {"started": True, "finished": False, "ansible_job_id": "j1.2"}
RESULT = {"name": "main", "pidfile": "/var/lib/dflash/main.pid", "changed": True, "status": "running",
          "pid": 4242, "how": "terminated", "previous_pid": 4100, "matched": True, "log_offset": 77,
          "invocation": {"module_args": {"name": "main"}}}


def test_a_job_has_ended_once_its_file_no_longer_says_started():
    assert run_job.parse_job(json.dumps(STARTED)) is None
    assert run_job.parse_job(json.dumps(RESULT)) == RESULT
    with pytest.raises(ValueError):
        run_job.parse_job("[1, 2]")


def test_an_ended_call_is_handed_back_as_it_returned_without_the_modules_bookkeeping():
    failed, result = run_job.job_outcome(RESULT)
    assert not failed and "invocation" not in result
    assert {key: result[key] for key in ("pid", "previous_pid", "how", "log_offset")} == {
        "pid": 4242, "previous_pid": 4100, "how": "terminated", "log_offset": 77}
    msg = "run main changed under this deploy: expected pid 4100, ... another deploy ..."
    failed, result = run_job.job_outcome({"failed": True, "msg": msg, "name": "main"})
    assert failed and result["msg"] == msg  # the call's own message, word for word


def test_the_async_wrappers_own_failure_says_the_call_did_not_end_by_itself():
    failed, result = run_job.job_outcome({"msg": "Timeout exceeded", "failed": True, "child_pid": 77})
    assert failed and result["msg"] == "the call in the container did not end by itself: Timeout exceeded"


@pytest.mark.parametrize(("path", "problem"), [
    ("/root/.ansible_async/j123456789.4242", None),
    ("j123456789.4242", "absolute"),
    ("/root/.ansible_async/../../etc/passwd", "named as"),
    ("/root/.ansible_async/j1.2.tmp", "named as"),
])
def test_only_a_job_file_of_the_async_wrapper_is_read(path, problem):
    found = run_job.job_file_problem(path)
    assert found is None if problem is None else problem in found


def test_a_missing_or_linked_job_file_fails_clearly(tmp_path):
    gone = tmp_path / "j1.2"
    with pytest.raises(RunError, match="is gone"):
        run_job.read_job(str(gone))
    (tmp_path / "elsewhere").write_text(json.dumps(RESULT))
    gone.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(RunError, match="symbolic link"):
        run_job.read_job(str(gone))


class FakeClock:
    """A clock that moves only when the wait sleeps; `on_sleep` runs at each sleep."""

    def __init__(self, on_sleep=None):
        self.now, self.sleeps, self.on_sleep = 0.0, 0, on_sleep

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds
        self.sleeps += 1
        if self.on_sleep:
            self.on_sleep(self.sleeps)


def test_the_wait_returns_at_the_first_read_after_the_job_ends(tmp_path):
    job = tmp_path / "j1.2"
    job.write_text(json.dumps(STARTED))
    clock = FakeClock(on_sleep=lambda n: n == 3 and job.write_text(json.dumps(RESULT)))
    assert run_job.wait_for_job(str(job), 30, clock=clock, sleep=clock.sleep) == RESULT
    assert clock.sleeps == 3  # 0.3 s of a 30 s wait: no added latency


def test_the_wait_returns_nothing_after_its_seconds_while_the_job_runs(tmp_path):
    job = tmp_path / "j1.2"
    job.write_text(json.dumps(STARTED))
    clock = FakeClock()
    assert run_job.wait_for_job(str(job), 2, clock=clock, sleep=clock.sleep) is None
    assert clock.now == pytest.approx(2.0, abs=run_job.JOB_POLL_SECONDS * 1.5)


def test_the_phase_names_what_the_call_does_while_its_writer_lives(tmp_path):
    pidfile = str(tmp_path / "main.pid")
    with run_job.Phases(pidfile, enabled=True) as phases:
        phases.set("the stop of pid 4100 (SIGTERM)")
        record = json.loads(open(run_job.phase_path(pidfile)).read())
        assert record["pid"] == os.getpid()
        said = run_job.read_phase(pidfile, now=record["since"] + 12.4)
        assert said == "the stop of pid 4100 (SIGTERM), 12 s so far"
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".phase-")]  # renamed into place
    assert not os.path.exists(run_job.phase_path(pidfile))  # removed on leaving
    with run_job.Phases(pidfile, enabled=False) as phases:  # check mode, status: nothing written
        phases.set("anything")
        assert not os.path.exists(run_job.phase_path(pidfile))


def test_a_phase_left_by_a_call_that_died_names_nothing(tmp_path):
    pidfile = str(tmp_path / "main.pid")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    record = {"doing": "the stop of pid 4100", "since": 0, "pid": int(gone.stdout), "start_time": 1}
    (tmp_path / "main.pid.phase").write_text(json.dumps(record))
    assert run_job.read_phase(pidfile) is None
    (tmp_path / "main.pid.phase").write_text("{not json")
    assert run_job.read_phase(pidfile) is None


def status_args(tmp_path, job, **extra):
    return {"name": "main", "state": "status", "pidfile": str(tmp_path / "main.pid"),
            "log_path": str(tmp_path / "main.log"), "async_results_file": str(job), **extra}


def test_status_of_an_ended_job_returns_the_calls_result_and_removes_the_job_file(tmp_path):
    job = tmp_path / "j7.8"
    job.write_text(json.dumps(RESULT))
    result, rc = run_module("training_run", status_args(tmp_path, job, wait_return_after=30))
    assert rc == 0 and result["finished"] is True, result
    assert (result["pid"], result["previous_pid"], result["changed"]) == (4242, 4100, True)
    assert result["invocation"]["module_args"]["async_results_file"] == str(job)  # this call's own
    assert not job.exists()


def test_status_of_a_failed_job_fails_with_the_calls_message(tmp_path):
    job = tmp_path / "j7.8"
    msg = "GPUs [0, 1] are not idle, so the run was not started: ..."
    job.write_text(json.dumps({"failed": True, "msg": msg, "name": "main", "gpu_idle": {"met": False}}))
    result, rc = run_module("training_run", status_args(tmp_path, job))
    assert rc == 1 and result["msg"] == msg and result["finished"] is True, result
    assert result["gpu_idle"] == {"met": False} and not job.exists()


def test_status_of_a_running_job_says_its_phase_and_the_logs_last_line(tmp_path):
    job = tmp_path / "j7.8"
    job.write_text(json.dumps(STARTED))
    (tmp_path / "main.log").write_text("first\nsaving the checkpoint, 3 s left\n")
    with run_job.Phases(str(tmp_path / "main.pid"), enabled=True) as phases:
        phases.set(run_job.stop_phase(4100, 60))
        result, rc = run_module("training_run", status_args(tmp_path, job, wait_return_after=0.5))
    assert rc == 0 and result["finished"] is False and not result["changed"], result
    assert result["waiting_for"].startswith(f"{run_job.stop_phase(4100, 60)}, ")
    assert result["progress"] == "saving the checkpoint, 3 s left"
    assert job.exists()  # read again at the next poll
    # No phase file (the call waits for the run's lock) and an empty log: still one line to print.
    result, rc = run_module("training_run", status_args(tmp_path, job, wait_return_after=0.2,
                                                        log_path=str(tmp_path / "empty.log")))
    assert rc == 0 and result["waiting_for"] == run_job.NO_PHASE and "no line in" in result["progress"]


@pytest.mark.parametrize(("extra", "words"), [
    ({"async_results_file": "/tmp/passwd"}, "named as"),
    ({"async_results_file": "/root/.ansible_async/j1.2", "state": "restarted", "command": ["/bin/true"]},
     "state=status"),
])
def test_a_bad_async_results_file_fails_before_anything_is_read(tmp_path, extra, words):
    args = {"name": "main", "state": "status", "pidfile": str(tmp_path / "main.pid"), **extra}
    result, rc = run_module("training_run", args)
    assert rc == 1 and words in result["msg"], result


# A restart begun as an async job and waited for by the status call, as the dflash_run role does, on this
# machine: the old run checkpoints on SIGTERM until the test has read STOP_LINES of the wait's lines naming
# the stop (then it creates the run's release file), so the count does not hang on the machine's speed.
STOP_LINES = 2
PLAY = """
- hosts: localhost
  gather_facts: false
  module_defaults:
    dflash.ops.training_run:
      {{name: slow, pidfile: "{dir}/slow.pid", log_path: "{dir}/slow.log", chdir: "{dir}"}}
  tasks:
    - name: Start a run that checkpoints on SIGTERM until its release file exists.
      dflash.ops.training_run:
        command: ["{python}", "{fake_run}", "--hold-term", "{dir}/release"]
      register: first
    - name: Begin its restart as an async job.
      dflash.ops.training_run:
        state: restarted
        command: ["{python}", "{fake_run}", "--step-after", "0"]
        expect_pid: "{{{{ first.pid }}}}"
        stop_timeout: 150
        wait_for: '"event": *"step"'
      async: 300
      poll: 0
      register: job
    - name: Wait for the restart, a line at each second.
      dflash.ops.training_run:
        state: status
        async_results_file: "{{{{ job.results_file }}}}"
        wait_return_after: 1
      register: restarted
      until: restarted.finished
      retries: 300
      delay: 0
    - name: Keep what the wait returned.
      ansible.builtin.copy:
        content: "{{{{ dict(restarted, first_pid=first.pid, job_file=job.results_file) | to_json }}}}"
        dest: "{dir}/restarted.json"
        mode: "0600"
"""


def play_releasing_the_stop(argv, env, cwd, release, stop_words, timeout=240):
    """Run ansible-playbook `argv`, reading its output as it comes; once STOP_LINES of the wait's lines
    name the stop (`stop_words`), create `release` (the old run's checkpoint ends). Returns (rc, output)."""
    env = dict(env, PYTHONUNBUFFERED="1")  # Display leaves flushing to the stream
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True)
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    output, seen = [], 0
    try:
        for line in proc.stdout:
            output.append(line)
            if "localhost: still waiting" in line and all(words in line for words in stop_words):
                seen += 1
                if seen == STOP_LINES:
                    Path(release).write_text("go")
        return proc.wait(), "".join(output)
    finally:
        watchdog.cancel()


def test_a_restart_run_as_an_async_job_says_what_it_waits_for_and_returns_its_result(tmp_path):
    play = tmp_path / "play.yml"
    play.write_text(PLAY.format(dir=tmp_path, python=sys.executable, fake_run=FAKE_RUN))
    env = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_ASYNC_DIR=str(tmp_path / "async"),
               PATH=f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    argv = [str(Path(VENV_BIN) / "ansible-playbook"), "-i", "localhost,", "-c", "local",
            "-e", f"ansible_python_interpreter={sys.executable}", str(play)]
    stop_words = ("still waiting for the stop of pid ", "saving the checkpoint")
    rc, output = play_releasing_the_stop(argv, env, tmp_path, tmp_path / "release", stop_words)
    assert rc == 0, output
    restarted = json.loads((tmp_path / "restarted.json").read_text())
    try:
        # The call's own result: the stop of the first run, then the new run and its first step.
        assert restarted["previous_pid"] == restarted["first_pid"] and restarted["how"] == "terminated"
        assert restarted["matched"] is True, restarted
        assert alive(restarted["pid"]) and not alive(restarted["first_pid"])
        # The stop lasted until the test saw STOP_LINES lines naming it (pid, timeout) with the
        # checkpoint's last log line.
        stop = run_job.stop_phase(restarted["first_pid"], 150)
        lines = [line for line in output.splitlines() if "localhost: still waiting" in line]
        during_stop = [line for line in lines if f"for {stop}" in line and "saving the checkpoint" in line]
        assert len(during_stop) >= STOP_LINES, output
        # No more lines than seconds waited, and the wait ended with the call, not at a poll's end.
        took = restarted["seconds"] + restarted["startup_seconds"]
        assert len(lines) <= math.ceil(took) + 1 and restarted["attempts"] <= math.ceil(took) + 1, output
        assert not os.path.exists(restarted["job_file"])  # cleaned up once read
        assert not os.path.exists(tmp_path / "slow.pid.phase")
    finally:
        if alive(restarted.get("pid") or 0):
            os.kill(restarted["pid"], 9)
