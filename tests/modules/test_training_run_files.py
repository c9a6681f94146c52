"""training_run never acts through a file someone else could have placed or changed: its log, its log
directory, its secrets file and its lock are refused when they are links or others can write them; and a
restart while another deploy holds the run's lock waits for it, then acts on the run as it is."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from module_runner import FAKE_RUN, alive, module_command

from tests.waiting import wait_for


def blocked_on_a_lock(pid: int) -> bool:
    """`pid` waits for a file lock: /proc/locks lists its request with `->` (a blocked waiter)."""
    return any(line.split()[1] == "->" and line.split()[5] == str(pid)
               for line in Path("/proc/locks").read_text().splitlines() if "->" in line)


def test_a_restart_waits_for_another_deploys_lock_then_acts_on_the_run_as_it_is(run, tmp_path):
    first = run.start()
    args_file = tmp_path / "restart-args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": run.args(
        state="restarted", command=[sys.executable, FAKE_RUN], expect_pid=first["pid"])}))
    lock_fd = os.open(f"{run.pidfile}.lock", os.O_RDWR)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        restart = subprocess.Popen(f"{module_command('training_run')} {args_file}", shell=True,
                                   stdout=subprocess.PIPE, text=True)
        # The restart waits for the lock (a blocked waiter in /proc/locks), the run untouched meanwhile.
        assert wait_for(lambda: any(blocked_on_a_lock(int(c)) for c in children(restart.pid)), timeout=60)
        assert alive(first["pid"]) and json.loads(run.pidfile.read_text())["pid"] == first["pid"]
    finally:
        os.close(lock_fd)
    out, _ = restart.communicate(timeout=120)
    result = json.loads(out)
    run.processes.track(result["pid"])
    assert restart.returncode == 0 and result["changed"] is True and result["pid"] != first["pid"], result
    assert not alive(first["pid"])


def children(pid: int) -> list[str]:
    """`pid` and its descendants (the shell and the module it runs)."""
    found, todo = [], [str(pid)]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            todo.extend((task / "children").read_text().split() if (task / "children").exists() else [])
    return found


def an_important_file(tmp_path):
    """A file root owns outside the run's directories (a stand-in for one under /etc)."""
    target = tmp_path / "etc" / "important.conf"
    target.parent.mkdir()
    target.write_text("important = yes\n")
    return target


@pytest.mark.parametrize("where", ["log", "log directory"])
def test_a_symlinked_log_is_refused_and_nothing_is_started_or_stopped(run, tmp_path, where):
    target = an_important_file(tmp_path)
    command = [sys.executable, FAKE_RUN]
    result, rc = run.call(state="started", command=command)
    assert rc == 0, result
    live = result["pid"]
    run.log.unlink()
    if where == "log":
        run.log.symlink_to(target)
    else:
        run.log.parent.rmdir()
        run.log.parent.symlink_to(target.parent)
        target.with_name(run.log.name).write_text("root's own\n")
    for state in ("restarted", "started"):
        result, rc = run.call(state=state, command=command + ["--other"])
        assert rc == 1, result
        assert "symbolic link" in result["msg"] and str(run.log) in result["msg"], result
        assert "nothing was signalled or started" in result["msg"], result
        assert alive(live) and json.loads(run.pidfile.read_text())["pid"] == live
    run.call(state="stopped")
    result, rc = run.call(state="started", command=command)
    assert rc == 1 and "symbolic link" in result["msg"] and not run.pidfile.exists(), result
    assert target.read_text() == "important = yes\n"  # nothing was appended through the link
    status, rc = run.call(state="status")
    assert rc == 0 and status["status"] == "stopped"
    # What the role checks before it stops a run.
    assert "symbolic link" in status["log_unsafe"] and str(run.log) in status["log_unsafe"]


@pytest.mark.parametrize("change, says", [("chmod 0666", "writable by other users (mode 0666)"),
                                          ("chown nobody", "owned by uid"),
                                          ("fifo", "not a regular file")])
def test_a_log_others_could_change_is_refused(run, change, says):
    run.log.parent.mkdir(parents=True)
    if change == "fifo":
        os.mkfifo(run.log)
    else:
        run.log.write_text("")
        if change == "chmod 0666":
            run.log.chmod(0o666)
        else:
            os.chown(run.log, 65534, 65534)
    result, rc = run.call(state="started", command=[sys.executable, FAKE_RUN])
    assert rc == 1 and says in result["msg"] and str(run.log) in result["msg"], result
    assert not run.pidfile.exists()


def test_the_status_never_reads_a_log_through_a_symlink(run, tmp_path):
    target = an_important_file(tmp_path)
    pid = run.start()["pid"]
    os.kill(pid, signal.SIGKILL)
    assert wait_for(lambda: not alive(pid))
    run.log.unlink()
    run.log.symlink_to(target)
    status, rc = run.call(state="status")
    assert rc == 0 and status["stale_pidfile"] is True
    assert "important" not in status["log_tail"]


def test_a_symlinked_secrets_file_or_lock_is_refused(run, tmp_path):
    secret = tmp_path / "etc" / "shadow"
    secret.parent.mkdir()
    secret.write_text("ROOT_ONLY=1\n")
    secret.chmod(0o600)
    env_file = tmp_path / "main.env"
    env_file.symlink_to(secret)
    result, rc = run.call(command=[sys.executable, FAKE_RUN], environment_file=str(env_file))
    assert rc == 1 and "environment_file" in result["msg"] and "symbolic link" in result["msg"], result
    assert not run.pidfile.exists()
    run.pidfile.parent.mkdir(parents=True)
    Path(f"{run.pidfile}.lock").symlink_to(tmp_path / "etc" / "created-through-the-lock")
    result, rc = run.call(command=[sys.executable, FAKE_RUN])
    assert rc == 1 and "lock file" in result["msg"] and "symbolic link" in result["msg"], result
    assert not (tmp_path / "etc" / "created-through-the-lock").exists()
