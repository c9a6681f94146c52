"""deploy.yml without the run's start, and what it leaves in the container: releases and the venv
that no other user can change.

One container (CT 200). The tests share the fleet and run in order.
"""

import pytest

from pvesim.fleet import Fleet, change_code

pytestmark = [pytest.mark.sim, pytest.mark.slow]

VMID = 200
NO_START = ("-e", "dflash_fleet_start_run=false")
# Anything under the deploy's directories that is not a symlink and is writable by group or others,
# or not owned by root, one `mode uid path` a line.
UNSAFE = ("find /opt/dflash ! -type l \\( -perm /022 -o ! -user root \\) -printf '%m %U %p\\n'")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("fleet-perms"), nodes=1, containers=(VMID,))
    yield f
    f.down()


def test_deploy_without_start_makes_the_release_live_and_starts_nothing(fleet):
    res = fleet.play("deploy.yml", *NO_START)
    assert res.rc == 0, res
    release = fleet.live_release(VMID)
    assert release.startswith("/opt/dflash/releases/")
    shipped = fleet.ct(VMID, f"test -x {release}/run.sh && test -x /opt/dflash/venv/bin/python")
    assert shipped.returncode == 0
    assert fleet.run_info(VMID) is None
    assert fleet.ct(VMID, "test -e /var/log/dflash/main.log").returncode != 0

    again = fleet.play("deploy.yml", *NO_START)
    assert again.rc == 0, again
    assert again.stats["ct200"]["changed"] == 0, again.stats


def test_releases_and_the_venv_are_writable_by_root_alone(fleet):
    listing = fleet.ct(VMID, "find /opt/dflash/releases /opt/dflash/venv -type f | wc -l")
    assert int(listing.stdout) > 20, listing  # the check below looks at a real tree
    unsafe = fleet.ct(VMID, UNSAFE)
    assert unsafe.returncode == 0 and unsafe.stdout == "", unsafe.stdout
    modes = fleet.ct(VMID, "cd /opt/dflash/current && stat -c '%a' /opt/dflash/releases . run.sh config.yaml")
    assert modes.stdout.split() == ["755", "755", "755", "644"], modes.stdout


def test_a_release_file_others_can_write_is_refused_and_nothing_is_switched(fleet):
    release = fleet.live_release(VMID)
    tampered = f"{release}/dflash_ops/train.py"
    assert fleet.ct(VMID, f"chmod o+w {tampered}").returncode == 0
    res = fleet.play("deploy.yml", *NO_START)
    assert res.rc != 0
    assert tampered in res.messages() and "writable by other users" in res.messages(), res
    assert fleet.live_release(VMID) == release

    # A new release is unpacked afresh and goes live; the tampered one is kept only as `previous`.
    change_code(fleet.src, "permissions")
    res = fleet.play("deploy.yml", *NO_START)
    assert res.rc == 0, res
    assert fleet.live_release(VMID) != release
    assert fleet.ct(VMID, "readlink /opt/dflash/previous").stdout.strip() == release
    unsafe = fleet.ct(VMID, f"{UNSAFE} | grep -v '^[0-9]* 0 {release}/'")
    assert unsafe.stdout == "", unsafe.stdout
