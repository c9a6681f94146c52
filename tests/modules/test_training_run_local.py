"""training_run run for real on this machine, against processes the tests start themselves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from module_runner import FAKE_RUN, alive, ansible_module, module_command, run_module

from tests.waiting import wait_for


def stat_fields(pid):
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rfind(")") + 2 :].split()


def test_start_writes_the_pidfile_and_detaches(run):
    result = run.start()
    pid = result["pid"]
    assert result["changed"] is True and result["status"] == "running"
    record = json.loads(run.pidfile.read_text())
    assert record == result["run"]
    assert record["pid"] == record["pgid"] == pid
    assert record["start_time"] == int(stat_fields(pid)[19])
    assert record["argv"] == [sys.executable, FAKE_RUN]
    assert record["name"] == "main" and record["log_path"] == str(run.log)
    assert oct(run.pidfile.stat().st_mode & 0o777) == "0o644"
    # A session of its own: no controlling terminal and no group shared with the connection.
    assert os.getpgid(pid) == pid and os.getsid(pid) == pid
    assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
    assert os.readlink(f"/proc/{pid}/fd/1") == os.readlink(f"/proc/{pid}/fd/2") == str(run.log)
    assert int(stat_fields(pid)[1]) != os.getpid()  # re-parented away from the module
    assert os.readlink(f"/proc/{pid}/cwd") == "/"  # not the module's temporary directory
    assert wait_for(lambda: "fake run" in run.log.read_text())


def test_only_stdio_is_inherited(run):
    result, rc = run.call(command=["/bin/sleep", "300"])
    assert rc == 0, result
    assert sorted(os.listdir(f"/proc/{result['pid']}/fd")) == ["0", "1", "2"]


def test_run_survives_the_teardown_of_the_session_that_started_it(run, tmp_path):
    """What closing `ssh node pct exec ...` does to the command's session: hang up and kill it."""
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": run.args(command=[sys.executable, FAKE_RUN])}))
    out = tmp_path / "out.json"
    shell = subprocess.Popen(
        ["bash", "-c", f"{module_command('training_run')} {args_file} > {out}; exec sleep 300"],
        start_new_session=True,
    )
    try:
        assert wait_for(lambda: out.exists() and out.read_text().strip().endswith("}"), timeout=30)
        pid = json.loads(out.read_text())["pid"]
        run.processes.track(pid)
        os.killpg(shell.pid, signal.SIGHUP)
        os.killpg(shell.pid, signal.SIGKILL)
    finally:
        shell.wait()
    time.sleep(0.3)
    assert alive(pid)


def test_started_again_is_unchanged_and_status_reports_the_run(run):
    first = run.start()
    again = run.start()
    assert again["changed"] is False and again["pid"] == first["pid"]
    assert "already running" in again["msg"]
    status, rc = run.call(state="status")
    assert rc == 0 and status["changed"] is False
    assert status["status"] == "running" and status["pid"] == first["pid"]
    assert status["run"]["argv"] == first["run"]["argv"]
    assert status["uptime"] >= 0


def test_a_different_command_is_refused_and_what_runs_is_named(run):
    first = run.start()
    result, rc = run.call(command=["/bin/sleep", "300"])
    assert rc == 1 and result["failed"]
    assert str(first["pid"]) in result["msg"] and "fake_run.py" in result["msg"]
    assert "restarted" in result["msg"]
    assert alive(first["pid"])
    assert json.loads(run.pidfile.read_text())["pid"] == first["pid"]


def test_stop_lets_the_run_checkpoint_and_removes_the_pidfile(run, tmp_path):
    marker, ready = tmp_path / "checkpointed", tmp_path / "ready"
    pid = run.start("--term-marker", str(marker), "--ready", str(ready))["pid"]
    assert wait_for(ready.exists)  # its SIGTERM handler is set: a stop before it would only kill it
    result, rc = run.call(state="stopped", stop_timeout=20)
    assert rc == 0, result
    assert result["changed"] is True and result["how"] == "terminated"
    assert result["pid"] == pid and result["signalled"] == [pid]
    assert marker.read_text() == "checkpointed"
    assert not alive(pid) and not run.pidfile.exists()
    again, rc = run.call(state="stopped")
    assert rc == 0 and again["changed"] is False and again["how"] == "already_stopped"


def test_stop_waits_for_a_helper_the_run_leaves_behind_without_signalling_it(run, tmp_path):
    """A run may hand the end of its checkpoint to a child and exit; the stop is complete only when
    that child is done, and the child started after SIGTERM is not sent one."""
    helper_done, ready = tmp_path / "helper", tmp_path / "ready"
    pid = run.start("--term-helper", str(helper_done), "--ready", str(ready))["pid"]
    assert wait_for(ready.exists)  # its SIGTERM handler is set (under load a stop could come first)
    result, rc = run.call(state="stopped", stop_timeout=20)
    assert rc == 0, result
    assert result["how"] == "terminated" and result["seconds"] >= 1
    assert helper_done.read_text() == "helper finished"
    assert result["signalled"] == [pid]
    assert len(result["processes"]) == 2 and pid in result["processes"]


def test_restarted_replaces_the_run(run):
    old = run.start()["pid"]
    result = run.start(state="restarted")
    assert result["changed"] is True and result["how"] == "terminated"
    assert result["previous_pid"] == old and result["pid"] != old
    assert not alive(old) and alive(result["pid"])
    assert json.loads(run.pidfile.read_text())["pid"] == result["pid"]


def test_a_run_that_ignores_sigterm_is_killed_after_stop_timeout(run, tmp_path):
    pid = run.start("--ignore-term", "--ready", str(tmp_path / "ready"))["pid"]
    assert wait_for((tmp_path / "ready").exists)
    result, rc = run.call(state="stopped", stop_timeout=1, kill_timeout=5)
    assert rc == 0, result
    assert result["how"] == "killed" and result["seconds"] >= 1
    assert not alive(pid)


def test_children_that_left_the_group_are_stopped_too(run):
    started = run.start("--escaped-child", str(run.dir / "escaped"), "--group-child", str(run.dir / "member"))
    pid = started["pid"]
    escaped, member = run.child_pid("escaped"), run.child_pid("member")
    assert os.getpgid(escaped) != pid and os.getpgid(member) == pid
    result, rc = run.call(state="stopped", stop_timeout=10)
    assert rc == 0, result
    assert set(result["signalled"]) == {pid, escaped, member}
    assert not any(alive(p) for p in (pid, escaped, member))


def test_the_shell_that_stops_and_a_decoy_named_like_the_run_survive(run, tmp_path, processes):
    """The seeds' trap: `pkill -f <script>` also matched the shell that ran it."""
    pid = run.start()["pid"]
    decoy = processes.spawn([sys.executable, "-c", "import time; time.sleep(300)", FAKE_RUN])
    args_file = tmp_path / "stop.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": run.args(state="stopped")}))
    shell = subprocess.run(
        ["bash", "-c", f"{module_command('training_run')} {args_file}; echo survived {FAKE_RUN}"],
        capture_output=True, text=True, timeout=60,
    )
    assert shell.returncode == 0, shell.stderr
    assert shell.stdout.strip().endswith(f"survived {FAKE_RUN}")
    assert json.loads(shell.stdout.strip().splitlines()[0])["how"] == "terminated"
    assert not alive(pid)
    assert alive(decoy.pid)


def test_pidfile_naming_an_unrelated_live_process_is_stale_and_it_survives(run, processes):
    bystander = processes.spawn(["/bin/sleep", "300"], start_new_session=True)
    start_time = int(stat_fields(bystander.pid)[19])
    run.pidfile.parent.mkdir(parents=True)
    # The pid was recorded by an earlier run that started at another moment: it has been reused.
    record = dict(pid=bystander.pid, pgid=bystander.pid, start_time=start_time - 1, argv=["x"])
    run.pidfile.write_text(json.dumps(record))
    status, rc = run.call(state="status")
    assert rc == 0 and status["status"] == "stopped" and status["stale_pidfile"] is True
    result, rc = run.call(state="stopped", stop_timeout=1)
    assert rc == 0, result
    assert result["how"] == "stale_pidfile" and result["changed"] is True and result["signalled"] == []
    assert not run.pidfile.exists()
    time.sleep(0.2)
    assert alive(bystander.pid)


def test_pidfile_of_a_dead_or_zombie_process_is_stale(run, processes):
    zombie = processes.spawn(["/bin/true"])
    assert wait_for(lambda: stat_fields(zombie.pid)[0] == "Z")  # exited, not yet reaped
    run.pidfile.parent.mkdir(parents=True)
    record = dict(pid=zombie.pid, pgid=zombie.pid, start_time=int(stat_fields(zombie.pid)[19]))
    run.pidfile.write_text(json.dumps(record))
    result, rc = run.call(state="stopped")
    assert rc == 0 and result["how"] == "stale_pidfile" and "zombie" in result["msg"]
    zombie.wait()
    run.pidfile.write_text(json.dumps(record))  # now the pid is gone altogether
    result, rc = run.call(state="stopped")
    assert rc == 0 and result["how"] == "stale_pidfile" and "dead" in result["msg"]


def test_start_over_a_stale_pidfile_starts_the_run(run):
    run.pidfile.parent.mkdir(parents=True)
    run.pidfile.write_text(json.dumps(dict(pid=2**22 + 7, pgid=2**22 + 7, start_time=1)))
    result = run.start()
    assert result["changed"] is True and result["stale_pidfile"] is True
    assert result["how"] == "stale_pidfile" and alive(result["pid"])


def test_a_run_that_dies_at_once_fails_with_its_log(run):
    result, rc = run.call(command=[sys.executable, FAKE_RUN, "--exit-at-once", "3"])
    assert rc == 1 and result["failed"]
    assert "exited with code 3" in result["msg"]
    assert "cannot load the config" in result["log_tail"]
    assert not run.pidfile.exists()


def test_a_successor_that_cannot_start_never_stops_the_running_run(run):
    pid = run.start()["pid"]
    for bad in (dict(command=["/nonexistent/run.sh"]), dict(command=["run.sh"], chdir="/nonexistent")):
        result, rc = run.call(state="restarted", **bad)
        assert rc == 1 and "Traceback" not in result["msg"]
        assert alive(pid)
    assert json.loads(run.pidfile.read_text())["pid"] == pid


def test_check_mode_changes_nothing(run, processes):
    result, rc = run.call(command=["/bin/sleep", "300"], _ansible_check_mode=True)
    assert rc == 0 and result["changed"] is True and not run.pidfile.exists()
    pid = run.start()["pid"]
    result, rc = run.call(state="stopped", _ansible_check_mode=True)
    assert rc == 0 and result["changed"] is True and "would stop" in result["msg"]
    assert alive(pid) and run.pidfile.exists()


@pytest.mark.parametrize(
    "args, complaint",
    [
        (dict(name="../etc/x", state="status"), "plain file name"),
        (dict(name="main", state="stopped", stop_timeout=-1), "stop_timeout must be >= 0"),
        (dict(name="main", state="started"), "command"),
        (dict(name="main", state="started", command=[]), "non-empty"),
        (dict(name="main", state="bogus"), "state"),
    ],
)
def test_bad_input_gets_a_clear_message(tmp_path, args, complaint):
    result, rc = run_module("training_run", dict(pidfile=str(tmp_path / "x.pid"), **args))
    assert rc == 1 and complaint in result["msg"]
    assert "Traceback" not in json.dumps(result)


@pytest.mark.parametrize("content", ["", f"{os.getpid()}\n", f'{{"pid": {os.getpid()}, "pgid"', "{not json"],
                         ids=["empty", "bare-pid", "truncated", "not-json"])
def test_a_pidfile_that_names_nothing_is_set_aside_and_the_start_proceeds(run, content):
    """Empty, a bare pid (this very test process), truncated, not JSON: nothing is signalled (this
    process lives on), the file is kept for inspection, and the run starts."""
    run.pidfile.parent.mkdir(parents=True)
    run.pidfile.write_text(content)
    status, rc = run.call(state="status")
    assert rc == 0 and status["status"] == "stopped" and status["stale_pidfile"] is True
    assert status["pidfile_problem"]
    result = run.start()
    assert result["stale_pidfile"] is True and result["how"] == "stale_pidfile"
    assert result["signalled"] == [] and alive(result["pid"])
    assert result["set_aside"] in result["msg"]
    assert Path(result["set_aside"]).read_text() == content
    assert json.loads(run.pidfile.read_text())["pid"] == result["pid"]


@pytest.mark.parametrize("mode", [0o666, 0o646, 0o664])
def test_a_pidfile_others_can_write_is_refused(run, mode):
    pid = run.start()["pid"]
    run.pidfile.chmod(mode)
    for state in ("stopped", "restarted", "started"):
        result, rc = run.call(state=state, command=[sys.executable, FAKE_RUN])
        assert rc == 1 and f"writable by other users (mode {mode:04o})" in result["msg"], result
        assert "chmod 0644" in result["msg"]
        assert alive(pid)
    status, rc = run.call(state="status")
    assert rc == 0 and status["pid"] == pid and "writable by other users" in status["pidfile_unsafe"]


def test_expect_pid_refuses_a_run_that_changed_meanwhile(run):
    first = run.start()["pid"]
    # A play that saw no run must not start a second one, nor stop the one somebody else started.
    result, rc = run.call(command=[sys.executable, FAKE_RUN], expect_pid=0)
    assert rc == 1 and "another deploy" in result["msg"] and f"pid {first}" in result["msg"]
    result, rc = run.call(state="stopped", expect_pid=first + 100000)
    assert rc == 1 and "another deploy" in result["msg"] and alive(first)
    # The run it saw is still there: it acts.
    result, rc = run.call(state="stopped", expect_pid=first)
    assert rc == 0 and result["how"] == "terminated" and not alive(first)
    # Its pidfile is gone: somebody stopped it since this play looked, so the play must not go on.
    result, rc = run.call(state="stopped", expect_pid=first)
    assert rc == 1 and "another deploy" in result["msg"] and "pidfile" in result["msg"]
    second = run.start(expect_pid=0)["pid"]
    assert second != first
    # A run that died on its own (its pidfile left behind, stale) counts as expected.
    os.kill(second, signal.SIGKILL)
    assert wait_for(lambda: not alive(second))
    result, rc = run.call(state="stopped", expect_pid=second)
    assert rc == 0 and result["how"] == "stale_pidfile" and result["signalled"] == []


def test_wait_for_returns_once_the_run_logs_progress(run):
    result = run.start("--step-after", "1.5", wait_for=r'"event": *"step"', wait_timeout=30)
    assert result["progress"] == '{"event": "step", "step": 1}'
    assert 1.5 <= result["startup_seconds"] < 15
    # A second run on the same log: the first run's step line does not count.
    result, rc = run.call(state="restarted", command=[sys.executable, FAKE_RUN], wait_for='"step"',
                          wait_timeout=2)
    assert rc == 1 and "logged nothing matching" in result["msg"] and "left running" in result["msg"]
    assert alive(result["pid"])
    run.processes.track(result["pid"])


def test_a_start_hands_a_slow_wait_over_to_a_status_that_reports_it(run):
    """wait_return_after: the start returns unmatched with the log's offset, and a status with wait_for from
    that offset says how far the run got (its last line) until the step, then that step's line."""
    run.log.parent.mkdir(parents=True, exist_ok=True)
    run.log.write_text('{"event": "step", "step": 99}\n')  # an earlier run's step: not this run's
    result = run.start("--step-after", "4", wait_for=r'"event": *"step"', wait_timeout=60,
                       wait_return_after=1)
    assert result["matched"] is False and result["status"] == "running", result
    assert result["log_offset"] >= len('{"event": "step", "step": 99}\n') and result["startup_seconds"] < 4
    waiting, rc = run.call(state="status", wait_for=r'"event": *"step"', log_offset=result["log_offset"])
    assert rc == 0 and waiting["matched"] is False and waiting["progress"].startswith("fake run "), waiting
    assert wait_for(lambda: run.call(state="status", wait_for='"step"', log_offset=result["log_offset"])[0][
        "matched"], timeout=30)
    done, _ = run.call(state="status", wait_for='"step"', log_offset=result["log_offset"])
    assert done["progress"] == '{"event": "step", "step": 1}', done
    # Without wait_return_after the call waits for the step itself, as before.
    again, rc = run.call(state="restarted", command=[sys.executable, FAKE_RUN, "--step-after", "1"],
                         wait_for='"step"', wait_timeout=30)
    assert rc == 0 and again["matched"] is True and again["progress"] == '{"event": "step", "step": 1}'


def test_wait_for_fails_with_the_log_when_the_run_dies(run):
    result, rc = run.call(command=[sys.executable, FAKE_RUN, "--exit-at-once", "2"], wait_for="step")
    assert rc == 1 and "exited with code 2" in result["msg"]
    assert "cannot load the config" in result["log_tail"] and not run.pidfile.exists()


def test_secrets_reach_the_run_from_its_environment_file_only(run, tmp_path):
    env_file = tmp_path / "main.env"
    env_file.write_text("HF_TOKEN=hf_not_a_real_token_42\n")
    env_file.chmod(0o600)
    result = run.start(environment_file=str(env_file))
    assert "hf_not_a_real_token_42" not in json.dumps(result)
    environ = Path(f"/proc/{result['pid']}/environ").read_bytes().split(b"\0")
    assert b"HF_TOKEN=hf_not_a_real_token_42" in environ


@pytest.mark.slow
def test_through_ansible(run):
    """The same module through the `ansible` command (AnsiballZ, local connection)."""
    start = ansible_module("training_run", run.args(command=[sys.executable, FAKE_RUN]))
    assert start.get("changed") is True, start
    run.processes.track(start["pid"])
    status = ansible_module("training_run", run.args(state="status"))
    assert status["status"] == "running" and status["pid"] == start["pid"]
    stop = ansible_module("training_run", run.args(state="stopped"))
    assert stop["how"] == "terminated" and not alive(start["pid"])
