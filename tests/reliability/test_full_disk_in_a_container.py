"""A full disk in a container (a size-limited mount, as a small mount point of a real container): the
run's output directory, its log's filesystem, the releases directory.

- checkpoints: a save the disk cannot hold is never picked, nothing of it is left, the previous
  checkpoint stays, and the run trains on saying why in status.json, its log and status.yml;
- the log: once its disk is full the run trains on, status.json and status.yml say that the log
  cannot be written, and when there is room again the log says how many lines were lost;
- a release unpack: fails naming what it needs and what is free, nothing is switched, the run goes on.

One container (CT 200 on pve1), deployed once for the module; each test puts it in the state it needs."""

import json
import re

import pytest

from pvesim.fleet import change_code
from tests.reliability.input_support import InputFleet, RunSnapshot, deployed_fleet, shown

pytestmark = [pytest.mark.sim, pytest.mark.slow, pytest.mark.reliability_full]

VMID = 200
OUTPUT = "/var/lib/dflash/runs/main"
LOG_DIR = "/var/log/dflash"
RELEASES = "/opt/dflash/releases"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    yield from deployed_fleet(tmp_path_factory.mktemp("full-disk"), nodes=1, containers=(VMID,))


def events(fleet):
    """The log's JSON lines; a full disk may have cut one short (the line after it starts afresh)."""
    found = []
    for line in (fleet.read(VMID, f"{LOG_DIR}/main.log") or "").splitlines():
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return [event for event in found if isinstance(event, dict) and "event" in event]


def status_table(fleet):
    res = fleet.play("status.yml")
    assert res.rc == 0, res
    return "\n".join(str(r.get("msg")) for _, _, r in res.host_results() if "msg" in r)


def stopped(fleet: InputFleet):
    res = fleet.play("stop_training.yml")
    assert res.rc == 0, res


def deployed(fleet: InputFleet):
    res = fleet.play("deploy.yml")
    assert res.rc == 0, res
    return fleet.run_info(VMID)


def small_mount(fleet, path, size, keep=""):
    """A tmpfs of `size` bytes at `path` in the container, its old content moved aside to `path`.full
    (`keep`: a shell glob of that content copied onto the new filesystem)."""
    copy = f" && cp -a {path}.full/{keep} {path}/" if keep else ""
    fleet.ct_sh(VMID, f"mv {path} {path}.full && mkdir -p {path} && mount -t tmpfs -o size={size},mode=0755 "
                      f"tmpfs {path}{copy}")


def unmount(fleet, path):
    """Undo small_mount (also one that failed half-way)."""
    fleet.ct(VMID, f"umount -l {path}; [ -d {path}.full ] && rmdir {path} && mv {path}.full {path}")


def test_a_checkpoint_the_disk_cannot_hold_is_never_picked_and_the_run_says_why(fleet):
    saved = fleet.wait_for_checkpoint(VMID)["last_checkpoint"]
    size = int(fleet.ct_sh(VMID, f"du -s --block-size=1 {saved} | cut -f1"))
    stopped(fleet)
    kept = fleet.status(VMID)["last_checkpoint"]
    name = kept.rsplit("/", 1)[1]
    try:
        # Room for the checkpoint the run resumes from and half another, not for a second one.
        small_mount(fleet, OUTPUT, size * 3 // 2 + 64 * 1024)
        fleet.ct_sh(VMID, f"mkdir {OUTPUT}/checkpoints && cp -a {OUTPUT}.full/checkpoints/{name} "
                          f"{OUTPUT}/checkpoints/")
        run = deployed(fleet)
        status = fleet.wait_for_status(VMID, lambda s: s.get("checkpoint_error"), timeout=180,
                                       what="checkpoint_error")
        error = status["checkpoint_error"]
        assert "No space left on device" in error and name in error, error
        failed_step = int(re.search(r"checkpoint step (\d+)", error).group(1))
        # The run goes on: same pid, more steps; the checkpoint it resumed from is the one to pick.
        later = fleet.wait_for_status(VMID, lambda s: s.get("step", 0) > failed_step + 3, timeout=120,
                                      what="steps after the failed save")
        assert fleet.run_info(VMID)["pid"] == run["pid"] and fleet.alive(VMID, run["pid"])
        assert later["last_checkpoint"] == kept
        assert fleet.ct_sh(VMID, f"ls -A {OUTPUT}/checkpoints").split() == [name]
        logged = [e for e in events(fleet) if e["event"] == "checkpoint_failed"]
        # Each failed save is logged (the status shows the latest; a slow poll may see a later one).
        assert failed_step in [e["step"] for e in logged], logged
        assert all(name in e["message"] and "No space left on device" in e["message"] for e in logged), logged
        table = status_table(fleet)
        assert "checkpoint: checkpoint step" in table and "No space left on device" in table, table
        print(f"full output disk: save of step {failed_step} failed ({error[:120]}...), "
              f"{name} kept, the run trained on to step {later['step']}")
    finally:
        stopped(fleet)
        unmount(fleet, OUTPUT)
    deployed(fleet)


def test_a_full_log_disk_leaves_the_run_training_and_says_so(fleet):
    stopped(fleet)
    try:
        small_mount(fleet, LOG_DIR, 1024 * 1024)
        run = deployed(fleet)
        fleet.ct(VMID, f"dd if=/dev/zero of={LOG_DIR}/filler bs=4k 2>/dev/null; true")
        status = fleet.wait_for_status(VMID, lambda s: s.get("log_error"), timeout=60, what="log_error")
        assert "the log cannot be written" in status["log_error"], status
        assert "No space left on device" in status["log_error"], status
        step = status["step"]
        fleet.wait_for_status(VMID, lambda s: s.get("step", 0) > step + 3, timeout=60, what="more steps")
        assert fleet.alive(VMID, run["pid"])
        assert "log error: the log cannot be written" in status_table(fleet)
        fleet.ct_sh(VMID, f"rm {LOG_DIR}/filler")
        fleet.wait_for_status(VMID, lambda s: s.get("log_error") is None, timeout=60,
                              what="log_error cleared")
        resumed = [e for e in events(fleet) if e["event"] == "log_resumed"]
        assert resumed and resumed[0]["lost_lines"] > 0, resumed
        print(f"full log disk: the run trained on, {resumed[0]['lost_lines']} line(s) lost, then it logged")
    finally:
        stopped(fleet)
        unmount(fleet, LOG_DIR)
    deployed(fleet)


def test_a_release_unpack_on_a_full_disk_fails_clearly_and_nothing_is_switched(fleet):
    deployed(fleet)
    before = RunSnapshot.take(fleet, VMID)
    # Room for the releases there are and a little more, not for another one.
    used = int(fleet.ct_sh(VMID, f"du -s --block-size=1 {RELEASES} | cut -f1"))
    try:
        small_mount(fleet, RELEASES, used + 128 * 1024, keep="*")
        change_code(fleet.src, "full disk")
        res = fleet.play("deploy.yml")
        assert res.rc != 0, res
        message = shown(res)
        assert "No space left on device" in message and "MiB free" in message, message
        assert "nothing was unpacked or switched" in message, message
        assert RunSnapshot.take(fleet, VMID) == before
        assert not fleet.ct_sh(VMID, f"ls -A {RELEASES} | grep staging || true").strip()
        print(f"full releases disk: {message[:200]}...; the run and the live release untouched")
    finally:
        unmount(fleet, RELEASES)
