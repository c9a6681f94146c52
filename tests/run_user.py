"""What a run as an unprivileged user (dflash_run_user) reads of the controller's files in a pvesim
container, put where that user may read it whatever the checkout's mode.

A sim container's trainer venv puts this venv's site-packages on its path (a .pth file:
inventory/sim/group_vars/training_containers.yml), and the containers see the machine's files at their own
paths (pvesim/container.py). A checkout in a directory the run's user may not enter (a clone made with
umask 077, or one in root's 0700 home) keeps its venv and the sim's assets out of that user's reach: the run
fails on its first import (`No module named 'torch'`), or the start refuses it, as it must. The tests leave
the checkout as it is and give the user copies: the site-packages in a directory of root's, 0755, under
/var/tmp (which the containers see through their overlay of the machine's /, unlike /tmp and /root), the
assets copied inside the container.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import sysconfig
import tempfile
from contextlib import contextmanager
from pathlib import Path

# Where readable_assets copies the sim's assets in a container (its own filesystem).
READABLE_ASSETS = "/srv/dflash-sim-assets"


@contextmanager
def site_packages_for_run_user():
    """This venv's site-packages where another user may read them: yields the directory, for
    dflash_env_site_packages; removed after. Enter it before the fleet's containers start. Each file is a
    hard link when it is root's, readable by others (runnable too where its owner may run it) and writable
    by root alone (no copy: seconds for the 90,000 files of torch and the rest), else a copy of root's that
    others may read."""
    base = Path(tempfile.mkdtemp(prefix="dflash-run-user-", dir="/var/tmp"))
    try:
        base.chmod(0o755)
        dest = base / "site-packages"
        _stage(Path(sysconfig.get_paths()["purelib"]), dest)
        yield str(dest)
    finally:
        shutil.rmtree(base)


def _stage(source, dest):
    device = os.stat(dest.parent).st_dev
    for directory, dirs, files in os.walk(source):
        target = dest / os.path.relpath(directory, source)
        target.mkdir()
        target.chmod(0o755)
        for name in dirs + files:
            path, copy = os.path.join(directory, name), target / name
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                copy.symlink_to(os.readlink(path))
                if name in dirs:
                    dirs.remove(name)
            elif stat.S_ISREG(info.st_mode):
                _link_or_copy(path, copy, info, device)


def _link_or_copy(path, copy, info, device):
    mode = stat.S_IMODE(info.st_mode)
    others_may = mode & stat.S_IROTH and (mode & stat.S_IXOTH or not mode & stat.S_IXUSR)
    if info.st_dev == device and info.st_uid == 0 and others_may and not mode & 0o022:
        os.link(path, copy)
    else:
        shutil.copyfile(path, copy)
        copy.chmod(0o755 if mode & stat.S_IXUSR else 0o644)


def readable_assets(fleet, vmid):
    """The sim's assets (the tiny target and data) copied where the run's user may read them, in container
    `vmid`'s own filesystem; returns the directory, for dflash_sim_assets. Not a chmod of the originals:
    they reach the container through its overlay's lower layer, or a read-only bind mount for a checkout
    under /tmp or /root (pvesim/container.py), and may sit in a directory of root's alone."""
    source, dest = shlex.quote(str(fleet.assets)), shlex.quote(READABLE_ASSETS)
    made = fleet.ct(vmid, f"cp -r {source} {dest} && chmod -R a+rX {dest}")
    assert made.returncode == 0, made.stderr
    return READABLE_ASSETS
