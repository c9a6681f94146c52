"""Bind mounts of provisioning (proxmox_provision_mounts, a container's mpN entries): a node directory
that is missing fails the provisioning before anything is created; a container made with a read-only and
a writable mount sees the node's files at its own paths, the read-only one refuses a write; a second run
changes nothing; a changed mount is reported and left alone, or changed with a reconcile (the container
restarts with it). The tests share one sim and run in order."""

import json

import pytest

from pvesim.fleet import Fleet

pytestmark = [pytest.mark.sim, pytest.mark.slow]

NEW = 201
HOST = f"ct{NEW}"
CREATE_TASK = "Ensure the container is as the inventory says (created and started when missing)."
CHECK_TASK = "Read the container on its node and check the inventory's config against the node."
MODEL_TEXT = "weights of the node\n"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("provision-mounts"), nodes=1, containers=(200,), gpus=0)
    # The node's directories (pvesim's node is this machine), under a path the containers do not see
    # through their overlay root (their /tmp is their own): only a bind mount shows them inside.
    f.node_dir = f.base / "node"
    (f.node_dir / "models").mkdir(parents=True)
    (f.node_dir / "models" / "model.txt").write_text(MODEL_TEXT)
    (f.node_dir / "cache").mkdir()
    f.add_to_inventory("pve1", NEW, proxmox_provision_cores=2, proxmox_provision_memory=4096,
                       proxmox_provision_rootfs_size=8)
    yield f
    f.down()


def mounts(fleet, models_ro=True, cache_at="/srv/cache"):
    return [{"node_path": str(fleet.node_dir / "models"), "container_path": "/srv/models",
             "read_only": models_ro},
            {"node_path": str(fleet.node_dir / "cache"), "container_path": cache_at}]


def provision(fleet, mount_list, *args):
    extra = json.dumps({"proxmox_provision_mounts": mount_list})
    return fleet.play("provision.yml", "-l", HOST, "-e", extra, *args)


def config_lines(fleet):
    return fleet.sim.ssh("pve1", f"pct config {NEW}").stdout.splitlines()


def test_a_missing_node_directory_fails_before_anything_is_created(fleet):
    missing = fleet.node_dir / "no-such-dir"
    res = provision(fleet, [*mounts(fleet), {"node_path": str(missing), "container_path": "/srv/x"}])
    assert res.rc != 0
    failed = res.results(CHECK_TASK)[HOST]
    words = f"{missing} (proxmox_provision_mounts, for /srv/x in CT {NEW}) does not exist on node pve1"
    assert failed["failed"] and words in failed["msg"], failed
    assert fleet.sim.ssh("pve1", f"pct status {NEW}").returncode != 0  # not created


def test_the_container_sees_the_node_files_and_the_read_only_mount_refuses_writes(fleet):
    res = provision(fleet, mounts(fleet))
    assert res.rc == 0, res
    assert res.results(CREATE_TASK)[HOST]["created"]
    lines = config_lines(fleet)
    assert f"mp0: {fleet.node_dir}/models,mp=/srv/models,replicate=0,ro=1" in lines, lines
    assert f"mp1: {fleet.node_dir}/cache,mp=/srv/cache,replicate=0" in lines, lines
    # An unprivileged container's root is uid 100000 on the node: the root-owned writable directory is
    # named as one it cannot write on a real node.
    warned = " ".join(res.results(CREATE_TASK)[HOST].get("warnings", []))
    assert f"{fleet.node_dir}/cache (uid 0, mode 0755) is not its" in warned, warned

    assert fleet.read(NEW, "/srv/models/model.txt") == MODEL_TEXT
    refused = fleet.ct(NEW, "echo x > /srv/models/new.txt")
    assert refused.returncode != 0 and "Read-only file system" in refused.stderr, refused
    assert not (fleet.node_dir / "models" / "new.txt").exists()
    assert fleet.ct(NEW, "echo features > /srv/cache/shard-0").returncode == 0
    assert (fleet.node_dir / "cache" / "shard-0").read_text() == "features\n"

    again = provision(fleet, mounts(fleet))
    assert again.rc == 0 and again.stats[HOST]["changed"] == 0, again


# Under make test-reliability only (half a minute): make test keeps the reconciliation of the other keys
# (test_provision.py) and the mounts' creation (the test above, test_example_inventory.py).
@pytest.mark.reliability_full
def test_a_changed_mount_is_reported_then_reconciled(fleet):
    # make test-reliability selects this test alone (-m), without the ones above that made the container
    # and wrote to its cache: do both here (after them, the provision changes nothing, the write the same).
    made = provision(fleet, mounts(fleet))
    assert made.rc == 0, made
    assert fleet.ct(NEW, "echo features > /srv/cache/shard-0").returncode == 0
    changed = mounts(fleet, models_ro=False, cache_at="/srv/features")
    before = config_lines(fleet)
    res = provision(fleet, changed)
    assert res.rc == 0 and res.stats[HOST]["changed"] == 0, res
    diffs = {d["key"]: d for d in res.results(CREATE_TASK)[HOST]["differences"]}
    assert diffs["mp0"]["want"] == f"{fleet.node_dir}/models,mp=/srv/models,replicate=0"
    assert not diffs["mp0"]["applied"]
    assert diffs["mp1"]["want"] == f"{fleet.node_dir}/cache,mp=/srv/features,replicate=0", diffs
    assert "differs from the inventory and was left as it is: mp0:" in res.stdout
    assert config_lines(fleet) == before

    res = provision(fleet, changed, "-e", "proxmox_provision_reconcile=true")
    assert res.rc == 0 and res.stats[HOST]["changed"] >= 1, res
    lines = config_lines(fleet)
    assert f"mp0: {fleet.node_dir}/models,mp=/srv/models,replicate=0" in lines and \
        f"mp1: {fleet.node_dir}/cache,mp=/srv/features,replicate=0" in lines, lines
    # The container restarted with the new mounts: the model directory is writable now, the cache moved.
    assert fleet.ct(NEW, "echo y > /srv/models/new.txt").returncode == 0
    assert (fleet.node_dir / "models" / "new.txt").read_text() == "y\n"
    assert fleet.read(NEW, "/srv/features/shard-0") == "features\n"
    assert fleet.ct(NEW, "test -e /srv/cache/shard-0").returncode != 0

    # Without the cache in the inventory, its mount point is a difference to remove.
    res = provision(fleet, changed[:1], "-e", "proxmox_provision_reconcile=true")
    assert res.rc == 0, res
    assert not any(line.startswith("mp1:") for line in config_lines(fleet))
    assert fleet.ct(NEW, "test -e /srv/features/shard-0").returncode != 0
