"""pct_container_check (the node check deploy.yml and restart_training.yml run first) and a container's
`lock:` or HA manager, against the stand-in pct of test_pct_container_check.py: a locked stopped container
is not started (the lock named, with what to do), a locked running one is checked with a warning (the
run's stop and start need only pct exec), an HA-managed one whose start only queued a request fails with
that reason. The messages are compared whole: they are the user's contract."""

from __future__ import annotations

import pytest
from test_pct_container_check import CONFIG, EIGHT_GPUS, NVIDIA_SMI, FakeNode, container

from ansible_collections.dflash.ops.plugins.module_utils.pct_locks import config_lock, lock_refusal

BACKUP_ADVICE = ("A backup (vzdump) of it is running: wait for it to end, then run this again (its task on "
                 "the node, or `vzdump --stop 1` there to end it). A backup killed outright leaves the lock, "
                 "which the node's next boot removes.")


def warning_texts(result):
    """The warnings of a module's result (ansible-core's structured warnings, or plain strings)."""
    return [w["event"]["msg"] if isinstance(w, dict) else w for w in result.get("warnings", [])]


@pytest.fixture
def node(tmp_path):
    return FakeNode(tmp_path)


def test_a_locked_stopped_container_is_not_started_and_the_lock_is_named(node):
    node.containers({201: container(status="stopped", config=[*CONFIG, "lock: backup"])})
    result, rc = node.check(vmid=201, start_stopped=True, required_gpus=[0])
    assert rc == 1 and result["msg"] == (
        "CT 201 on node pve1 is locked (backup): pve-container refuses pct start 201 until the lock goes, so "
        "nothing was changed. " + BACKUP_ADVICE)
    assert result["lock"] == "backup" and result["started"] is False and result["changed"] is False
    assert node.status(201) == "stopped" and [call[0] for call in node.calls()] == ["status", "config"]


def test_a_stale_create_lock_says_to_unlock_and_destroy_it(node):
    node.containers({202: container(status="stopped", config=["lock: create"])})
    result, rc = node.check(vmid=202, start_stopped=True)
    assert rc == 1 and result["msg"] == (
        "CT 202 on node pve1 is locked (create): pve-container refuses pct start 202 until the lock goes, so "
        "nothing was changed. A `pct create 202` did not finish (killed or failed half-way), or is still "
        "running: once no `pct create 202` runs on the node, `pct unlock 202` and `pct destroy 202` there "
        "remove the half-made container, and provisioning creates it again.")
    assert node.status(202) == "stopped"


def test_a_locked_running_container_is_checked_with_a_warning(node):
    node.containers({200: container(config=[*CONFIG, "lock: backup"], smi=EIGHT_GPUS)})
    result, rc = node.check(vmid=200, required_gpus=[0, 7])
    assert rc == 0 and result["gpu_count"] == 8 and result["lock"] == "backup", result
    assert warning_texts(result) == [
        "CT 200 on node pve1 is locked (backup): the run's stop and start go on through pct exec, which no "
        "lock refuses, but pct start, shutdown, set and destroy of it are refused until the lock goes (a "
        "backup (vzdump) of it is running: wait for it to end, then run this again (its task on the node, or "
        "`vzdump --stop 1` there to end it). A backup killed outright leaves the lock, which the node's next "
        "boot removes)."]
    assert node.calls() == [["status", "200"], ["config", "200"], ["exec", "200", "--", *NVIDIA_SMI]]


def test_an_ha_managed_container_whose_start_only_queued_a_request_fails_with_the_reason(node):
    node.containers({203: {**container(status="stopped"), "ha": True}})
    result, rc = node.check(vmid=203, start_stopped=True, required_gpus=[0])
    assert rc == 1 and result["msg"] == (
        "CT 203 on node pve1 is managed by the HA manager: pct start 203 only queued a request with it "
        "(Requesting HA start for CT 203) and returned: the container is not running. Start or stop it "
        "through HA (`ha-manager set ct:203 --state started` or `--state stopped` on the node, then wait for "
        "`ha-manager status`), or take it out of HA (`ha-manager remove ct:203`) for provisioning and the "
        "node checks to manage it.")
    assert "exec" not in [call[0] for call in node.calls()]


@pytest.mark.parametrize("lock", ["snapshot", "migrate"])
def test_other_locks_name_the_task_that_holds_them(lock):
    assert config_lock({"lock": lock, "cores": "2"}) == lock and config_lock({"cores": "2"}) is None
    assert lock_refusal(200, "pve1", lock, "pct set 200").endswith(
        f"A Proxmox task ({lock}: a migration, snapshot, rollback or disk move) holds it: wait for that task "
        "to end (the node's task log).")
