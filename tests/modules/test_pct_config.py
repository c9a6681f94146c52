"""proxmox_container's wanted config as pve-container writes it: bind mounts with `replicate=0`, nesting in
an unprivileged container; their comparison with what a node has; a reconcile's restart through `pct
shutdown`."""

from __future__ import annotations

import pytest

from ansible_collections.dflash.ops.plugins.module_utils.pct_config import config_differences, wanted_config
from ansible_collections.dflash.ops.plugins.modules.proxmox_container import SHUTDOWN_TIMEOUT, reconcile

PARAMS = dict(hostname="ct200", vmid=200, cores=2, memory=4096, swap=0, rootfs_storage="local-lvm",
              rootfs_size=8, unprivileged=True, onboot=True, nesting=True, networks={}, gpus=[],
              control_devices=[], device_gid=44,
              mounts=[{"node_path": "/srv/models", "container_path": "/srv/models", "read_only": True},
                      {"node_path": "/srv/features/ct200", "container_path": "/srv/features",
                       "read_only": False}])


def test_bind_mounts_are_kept_out_of_replication_in_pve_container_s_key_order():
    wanted = wanted_config(PARAMS)
    assert wanted["mp0"] == "/srv/models,mp=/srv/models,replicate=0,ro=1"
    assert wanted["mp1"] == "/srv/features/ct200,mp=/srv/features,replicate=0"


@pytest.mark.parametrize("unprivileged, nesting, features", [
    (True, True, "nesting=1"), (True, False, None), (False, True, None)])
def test_nesting_is_on_in_an_unprivileged_container_unless_turned_off(unprivileged, nesting, features):
    wanted = wanted_config({**PARAMS, "unprivileged": unprivileged, "nesting": nesting})
    assert wanted.get("features") == features


def test_a_mount_without_replicate_0_or_a_container_without_nesting_differs_and_extra_flags_do_not():
    wanted = wanted_config(PARAMS)
    on_node = {**wanted, "rootfs": "local-lvm:vm-200-disk-0,size=8G"}
    have = {**on_node, "mp0": "/srv/models,mp=/srv/models,ro=1", "features": "keyctl=1,nesting=1"}
    assert [d["key"] for d in config_differences(wanted, have)] == ["mp0"]
    have = {**on_node}
    del have["features"]
    assert [(d["key"], d["have"], d["want"]) for d in config_differences(wanted, have)] == [
        ("features", None, "nesting=1")]


class Pct:
    node = "pve1"

    def __init__(self):
        self.calls = []

    def must(self, *args, timeout=None):
        self.calls.append(args)
        return ""


def test_a_running_container_s_new_mount_restarts_it_through_a_shutdown_not_a_stop():
    pct = Pct()
    reconcile(pct, 200, [{"key": "mp1", "have": None, "want": "/srv/x,mp=/srv/x,replicate=0"}], running=True)
    assert pct.calls == [("set", 200, "--mp1", "/srv/x,mp=/srv/x,replicate=0"),
                         ("shutdown", 200, "--timeout", SHUTDOWN_TIMEOUT, "--forceStop", "1"),
                         ("start", 200)]
