"""The run's log is private by default: the start makes it 0640, root's group's (an earlier release's 0644 log
too), so another user of the container (`nobody`) cannot read it; with output_group it is that group's, and
the run gets DFLASH_OUTPUT_GROUP, with which the trainer shares its outputs (tests/dflash/core/
test_output_modes.py). A group the container does not have is refused before anything is stopped."""

from __future__ import annotations

import grp
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from module_runner import alive

NOBODY = 65534
SHARED_GROUP = "video"
SAYS_GROUP = ("import os, time; print('group', os.environ.get('DFLASH_OUTPUT_GROUP'), flush=True); "
              "time.sleep(60)")


@pytest.fixture
def base():
    """A directory every user can enter, the log's (tmp_path is root's 0700: nobody reads anything in it)."""
    path = Path(tempfile.mkdtemp(prefix="dflash-log-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def nobody_reads(path):
    pid = os.fork()
    if pid == 0:  # the child, as nobody: exit 0 when it could read the file
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with open(path, "rb"):
                os._exit(0)
        except OSError:
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0


def test_the_log_is_made_0640_and_nobody_reads_it(run, base):
    run.log = base / "log" / "main.log"
    run.log.parent.mkdir()
    run.log.write_text("an earlier release's log\n")
    run.log.chmod(0o644)
    assert nobody_reads(run.log)  # what an earlier release left: anyone read the run's lines
    run.start()
    info = run.log.stat()
    assert (info.st_mode & 0o7777, info.st_gid) == (0o640, 0) and not nobody_reads(run.log)


def test_the_output_group_gets_the_log_and_the_run_its_name(run, base):
    gid = grp.getgrnam(SHARED_GROUP).gr_gid
    run.log = base / "main.log"
    result, rc = run.call(command=[sys.executable, "-c", SAYS_GROUP], output_group=SHARED_GROUP,
                          wait_for="^group ", startup_wait=0)
    assert rc == 0, result
    assert f"group {gid}" in run.log.read_text()
    info = run.log.stat()
    assert (info.st_mode & 0o7777, info.st_gid) == (0o640, gid) and not nobody_reads(run.log)


def test_an_output_group_the_container_lacks_is_refused_before_anything_is_stopped(run, base):
    first = run.start()
    result, rc = run.call(state="restarted", command=[sys.executable, "-c", SAYS_GROUP],
                          output_group="no-such-group-65")
    assert rc == 1 and "output_group 'no-such-group-65' is not a group" in result["msg"], result
    assert alive(first["pid"]) and json.loads(run.pidfile.read_text())["pid"] == first["pid"]
