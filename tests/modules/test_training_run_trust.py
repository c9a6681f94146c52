"""What runs as root is root's, and no name on the way to a path can redirect it: training_run refuses
a run.sh, a release tree or an interpreter that another user owns or could write, before anything is
stopped; its files are reached from / one name at a time (module_utils/safe_paths.py), so a directory
above them swapped for a symbolic link in another user's directory redirects no write."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from module_runner import FAKE_RUN, alive

from ansible_collections.dflash.ops.plugins.module_utils import safe_paths

NOBODY = 65534


def release(tmp_path, name="r1"):
    """A release as dflash_release_tree unpacks it: root's, run.sh execs the venv's python."""
    tree = tmp_path / "opt" / "releases" / name
    (tree / "dflash").mkdir(parents=True)
    (tree / "dflash" / "train.py").write_text("# the trainer\n")
    venv = tmp_path / "opt" / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").symlink_to(sys.executable)
    run_sh = tree / "run.sh"
    run_sh.write_text(f"#!/bin/sh\nexec {venv / 'python'} {FAKE_RUN}\n")
    run_sh.chmod(0o755)
    return tree


def another_users_script(run_sh: Path, marker: Path):
    """run.sh rewritten and owned by an unprivileged user."""
    run_sh.write_text(f"#!/bin/sh\necho EVIL > {marker}\n")
    os.chown(run_sh, NOBODY, NOBODY)


def start_args(tree, interpreter=True, **extra):
    """The start of `tree`'s run.sh as launch.yml asks for it (with the venv's python as `interpreter`)."""
    if interpreter:
        extra["interpreter"] = str(tree.parent.parent / "venv" / "bin" / "python")
    return dict(command=[str(tree / "run.sh")], chdir=str(tree), **extra)


def test_a_release_of_roots_starts(run, tmp_path):
    tree = release(tmp_path)
    result, rc = run.call(**start_args(tree))
    assert rc == 0 and result["status"] == "running", result


@pytest.mark.parametrize("change", ["run.sh of another user", "run.sh group-writable",
                                    "code writable by others", "release of another user",
                                    "venv of another user"])
def test_what_runs_as_root_must_be_roots_and_nothing_is_stopped_when_it_is_not(run, tmp_path, change):
    first = run.start()
    tree = release(tmp_path)
    marker = tmp_path / "evil-ran"
    culprit = {"run.sh of another user": tree / "run.sh", "run.sh group-writable": tree / "run.sh",
               "code writable by others": tree / "dflash" / "train.py", "release of another user": tree,
               "venv of another user": tmp_path / "opt" / "venv" / "bin"}[change]
    if change == "run.sh of another user":
        another_users_script(tree / "run.sh", marker)
    elif change == "run.sh group-writable":
        culprit.chmod(0o775)
    elif change == "code writable by others":
        culprit.chmod(0o666)
    else:
        os.chown(culprit, NOBODY, NOBODY)
    result, rc = run.call(state="restarted", expect_pid=first["pid"],
                          **start_args(tree, interpreter=change == "venv of another user"))
    assert rc == 1, result
    assert str(culprit) in result["msg"] and "chmod go-w" in result["msg"], result["msg"]
    assert "nothing was signalled or started" in result["msg"]
    assert alive(first["pid"]) and json.loads(run.pidfile.read_text())["pid"] == first["pid"]
    assert not marker.exists()


@pytest.fixture
def roots_tree(tmp_path):
    """A tree only root writes (a stand-in for /etc), with a directory the run could be sent to."""
    tree = tmp_path / "etc"
    (tree / "logs").mkdir(parents=True)
    return tree


def test_a_parent_swapped_for_a_symlink_in_another_users_directory_redirects_no_write(tmp_path, roots_tree):
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    (home / "dflash").symlink_to(roots_tree)  # what that user put in place of the run's directory
    log = home / "dflash" / "logs" / "main.log"
    with pytest.raises(safe_paths.UnsafePath) as refused:
        safe_paths.open_file(str(log), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    assert str(home) in str(refused.value) and "uid 65534" in str(refused.value)
    assert list((roots_tree / "logs").iterdir()) == []


def test_a_start_whose_log_is_reached_through_a_swapped_parent_writes_nothing(run, tmp_path, roots_tree):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # writable by every user, not sticky: anyone may rename what is in it
    (shared / "dflash").symlink_to(roots_tree)
    run.log = shared / "dflash" / "logs" / "main.log"
    result, rc = run.call(command=[sys.executable, FAKE_RUN])
    assert rc == 1 and str(shared / "dflash") in result["msg"] and "symbolic link" in result["msg"], result
    assert list((roots_tree / "logs").iterdir()) == [] and not run.pidfile.exists()


def test_a_directory_on_the_way_in_a_directory_every_user_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    (shared / "dflash").mkdir(parents=True)
    shared.chmod(0o777)
    with pytest.raises(safe_paths.UnsafePath, match="every user can write to"):
        safe_paths.open_file(str(shared / "dflash" / "main.log"), os.O_WRONLY | os.O_CREAT)
    assert not (shared / "dflash" / "main.log").exists()


def test_a_link_on_the_way_that_only_root_could_have_made_is_followed(tmp_path):
    (tmp_path / "run" / "dflash").mkdir(parents=True)
    (tmp_path / "var").mkdir()
    (tmp_path / "var" / "run").symlink_to("../run")  # as /var/run -> /run
    fd = safe_paths.open_file(str(tmp_path / "var" / "run" / "dflash" / "main.pid"), os.O_WRONLY | os.O_CREAT)
    os.close(fd)
    assert (tmp_path / "run" / "dflash" / "main.pid").is_file()
