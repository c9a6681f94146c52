"""The pidfile's lock is root's alone: no other local user can open it, so none can hold it and block a
stop, a restart or a deploy; a lock file an earlier release made 0644 is made 0600 at the next call; and
a lock held anyway is waited for at most a bound, then named with its holder's pid."""

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from ansible_collections.dflash.ops.plugins.module_utils.run_pidfile import (
    RunError,
    pidfile_lock,
    take_lock,
)

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
LOCK_IT = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); "
           "fcntl.flock(fd, fcntl.LOCK_EX); ")
HOLD = LOCK_IT + "print('held', flush=True); time.sleep(120)"


@pytest.fixture
def shared_dir():
    """A directory every user can reach (pytest's own is root's alone)."""
    base = Path(tempfile.mkdtemp(dir="/var/tmp"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base)


def as_nobody(*argv, **kwargs):
    return subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
                            **kwargs)


def hold_as_nobody(lock):
    """A process of nobody's holding an flock on `lock` (opened read-only); None when it could not open it."""
    proc = as_nobody("/usr/bin/python3", "-c", HOLD, str(lock), stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
    if proc.stdout.readline().strip() == "held":
        return proc
    proc.wait(timeout=30)
    return None


@needs_root
def test_the_lock_is_root_s_alone_and_another_user_cannot_hold_it(shared_dir):
    pidfile = shared_dir / "main.pid"
    with pidfile_lock(str(pidfile), enabled=True):
        pass
    lock = Path(f"{pidfile}.lock")
    assert stat.S_IMODE(lock.stat().st_mode) == 0o600 and lock.stat().st_uid == 0
    assert hold_as_nobody(lock) is None  # Permission denied: nobody never gets a descriptor


@needs_root
def test_an_earlier_0644_lock_is_made_0600_and_one_held_meanwhile_is_named_after_a_bounded_wait(shared_dir):
    pidfile = shared_dir / "main.pid"
    lock = Path(f"{pidfile}.lock")
    lock.touch(mode=0o644)
    lock.chmod(0o644)
    holder = hold_as_nobody(lock)
    assert holder is not None
    try:
        with pytest.raises(RunError) as refused:
            with pidfile_lock(str(pidfile), enabled=True, wait=0.5):
                pass
        assert f"held after 0 s, by pid {holder.pid}" in str(refused.value)
        assert "nothing was signalled or started" in str(refused.value)
        assert stat.S_IMODE(lock.stat().st_mode) == 0o600
        assert hold_as_nobody(lock) is None  # a new descriptor is refused now
    finally:
        holder.kill()
        holder.wait()
    with pidfile_lock(str(pidfile), enabled=True, wait=5):  # the holder gone, the lock is free at once
        pass


def test_a_lock_freed_within_the_wait_is_taken(tmp_path):
    lock = tmp_path / "main.pid.lock"
    lock.touch()
    script = LOCK_IT + "print('held', flush=True); sys.stdin.readline()"
    holder = subprocess.Popen(["/usr/bin/python3", "-c", script, str(lock)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    fd = os.open(lock, os.O_RDWR)
    try:
        holder.stdin.write("\n")
        holder.stdin.flush()  # it exits, and its lock goes with it
        take_lock(fd, str(lock), wait=60)
    finally:
        os.close(fd)
        holder.wait()
