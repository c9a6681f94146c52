"""pvesim on a shared machine gives no local user root: it makes its state dir itself (root's, 0700) or
refuses one that is there and is not, or that another user could replace (a directory of theirs above it),
before anything is read, started or written there; root's authorized_keys of the nodes is in a root-only
directory of pvesim's (host.KEYS), not in the state dir; and the nodes' sshd runs with StrictModes, as a
stock node's (OpenSSH misc.c safe_path()): a key file another user could change lets no one in."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

import pvesim
from pvesim import host

pytestmark = pytest.mark.sim

NOBODY = 65534


def nobody_may_append(path):
    """Whether `nobody` can open `path` to add a line (a key of their own)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with open(path, "a"):
                os._exit(0)
        except OSError:
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0


@pytest.fixture
def shared_tmp():
    """A directory in /tmp as any user could make one there (tmp_path is root's 0700)."""
    path = Path(tempfile.mkdtemp(prefix="pvesim-shared-"))
    yield path
    pvesim.down(path / "state")
    for name in ("state", "hosts.yml"):
        target = path / name
        if target.is_dir():
            os.chmod(target, 0o700)
            for child in target.iterdir():
                child.unlink()
            target.rmdir()
    path.rmdir()


@pytest.mark.parametrize("made_by", ["another user", "root, mode 0755",
                                     "root, under another user's directory"])
def test_a_state_dir_pvesim_did_not_make_private_is_refused_before_anything_starts(shared_tmp, made_by):
    state = shared_tmp / "state"
    if made_by == "another user":
        state.mkdir(mode=0o700)
        os.chown(state, NOBODY, NOBODY)
    elif made_by == "root, mode 0755":
        state.mkdir()
        state.chmod(0o755)
    else:
        os.chown(shared_tmp, NOBODY, NOBODY)  # that user may rename state and put their own in its place
        state.mkdir(mode=0o700)
    with pytest.raises(pvesim.SimError, match="state dir refused") as refused:
        pvesim.up(nodes=1, containers=(385,), gpus=0, state_dir=state, inventory=shared_tmp / "hosts.yml")
    assert str(state) in str(refused.value) and "pvesim down --state-dir" in str(refused.value)
    assert list(state.iterdir()) == [] and state.resolve() not in host.registered_state_dirs()
    assert not (shared_tmp / "hosts.yml").exists()
    os.chown(shared_tmp, 0, 0)


def test_pvesim_makes_its_state_dir_and_keeps_root_keys_where_strict_sshd_reads_them(shared_tmp):
    shared_tmp.chmod(0o1777)  # as /tmp: a state dir under a directory every user can write to (sticky)
    s = pvesim.up(nodes=1, containers=(386,), gpus=0, state_dir=shared_tmp / "state",
                  inventory=shared_tmp / "hosts.yml")
    info = s.state_dir.stat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o700)
    keys = s.authorized_keys
    assert not keys.is_relative_to(s.state_dir) and keys.parent.parent == host.KEYS
    assert stat.S_IMODE(keys.parent.stat().st_mode) == 0o700 and not nobody_may_append(keys)
    config = (s.state_dir / "nodes" / "pve1" / "sshd_config").read_text()
    assert "StrictModes yes" in config and f"AuthorizedKeysFile {keys}" in config
    assert s.ssh("pve1", "id -u").stdout.strip() == "0"  # StrictModes accepts the sim's own key file
    keys.chmod(0o602)  # a key file every user could change: a stock sshd lets no one in with it
    try:
        assert s.ssh("pve1", "id -u").returncode != 0
    finally:
        keys.chmod(0o600)
    assert s.ssh("pve1", "id -u").stdout.strip() == "0"
    pvesim.down(s.state_dir)
    assert not keys.parent.exists()
