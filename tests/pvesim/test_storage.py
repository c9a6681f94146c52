"""A node's storages and templates as a default Proxmox VE 8 install has them (docs/PVESIM.md,
"Provisioning"): `local` holds templates, ISO images and backups, `local-lvm` container and VM disks;
`pct create` refuses a root disk on a storage without rootdir content; `pveam` offers only its index's
templates, and the index moves on. The node's pvesm, pveam and pvesh answer at their absolute paths,
through sudo too."""

import json

import pytest

import pvesim
from pvesim import host, node, prerequisites

pytestmark = pytest.mark.sim

TEMPLATE = f"local:vztmpl/{node.TEMPLATE}"
USER = "ansible"
PROVISION_RULE = host.PACKAGE_BIN.parents[1] / "inventory/production.example/sudoers.d/ansible_provision"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One node with CT 420 (no GPU), reached as the node user under the provision rule."""
    base = tmp_path_factory.mktemp("storage")
    s = pvesim.up(nodes=1, containers=(420,), gpus=1, state_dir=base / "state", inventory=base / "hosts.yml",
                  node_user=USER, sudo_rule=PROVISION_RULE)
    yield s
    pvesim.down(s.state_dir)


def rows(output):
    return [line.split() for line in output.splitlines()[1:]]


def test_pvesm_status_lists_the_storages_of_a_content_type_only(store):
    every = store.ssh("pve1", "pvesm status")
    header = ["Name", "Type", "Status", "Total", "Used", "Available", "%"]
    assert every.stdout.splitlines()[0].split() == header
    assert [r[:3] for r in rows(every.stdout)] == [["local", "dir", "active"],
                                                   ["local-lvm", "lvmthin", "active"]]
    assert [r[0] for r in rows(store.ssh("pve1", "pvesm status --content rootdir").stdout)] == ["local-lvm"]
    assert [r[0] for r in rows(store.ssh("pve1", "pvesm status --content vztmpl,iso").stdout)] == ["local"]
    # The hand-built CT 420's 32 GiB disk is on local-lvm, and counts there.
    lvm = rows(store.ssh("pve1", "pvesm status --storage local-lvm").stdout)[0]
    assert int(lvm[4]) == 32 * 1024 * 1024
    filtered = store.ssh("pve1", "pvesm status --storage local --content rootdir")
    assert filtered.returncode == 255
    assert filtered.stderr.startswith("400 Parameter verification failed.\nstorage: No such storage.\n")


def test_a_root_disk_goes_on_local_lvm_and_local_refuses_it(store):
    refused = store.ssh("pve1", f"pct create 421 {TEMPLATE} --rootfs local:8")
    assert refused.returncode == 255
    assert refused.stderr.startswith("400 Parameter verification failed.\n"
                                     "storage: storage 'local' does not support container directories\n")
    # Without --rootfs, pct's default (`--storage`, default local, 4 GiB) is refused the same way.
    default = store.ssh("pve1", f"pct create 421 {TEMPLATE}")
    assert "storage 'local' does not support container directories" in default.stderr
    assert store.ssh("pve1", "pct config 421").returncode == 2  # nothing was made
    made = store.ssh("pve1", f"pct create 421 {TEMPLATE} --rootfs local-lvm:8")
    try:
        assert made.returncode == 0, made.stderr
        config = store.ssh("pve1", "pct config 421").stdout.splitlines()
        assert "rootfs: local-lvm:vm-421-disk-0,size=8G" in config
        lvm = rows(store.ssh("pve1", "pvesm status --storage local-lvm").stdout)[0]
        assert int(lvm[4]) == (32 + 8) * 1024 * 1024
    finally:
        store.ssh("pve1", "pct destroy 421")
    missing = store.ssh("pve1", f"pct create 421 {TEMPLATE} --rootfs tank:8")
    assert (missing.returncode, missing.stderr) == (255, "storage 'tank' does not exist\n")


def test_pveam_offers_its_index_and_downloads_only_what_it_lists(store):
    files = node.NodeFiles(store.state_dir, "pve1")
    listed = store.ssh("pve1", "pveam available --section system").stdout.splitlines()
    assert listed == [f"{'system':<15} {t}" for t in sorted(node.TEMPLATE_INDEX["system"])]
    assert "turnkeylinux" in store.ssh("pve1", "pveam available").stdout
    bad = store.ssh("pve1", "pveam available --section nope")
    assert bad.returncode == 255
    assert "section: value 'nope' does not have a value in the enumeration" in bad.stderr
    unknown = store.ssh("pve1", f"pveam download local {node.NEWER_TEMPLATE}")
    assert unknown.returncode == 255
    assert unknown.stderr.startswith("400 Parameter verification failed.\ntemplate: no such template\n")
    no_templates = store.ssh("pve1", f"pveam download local-lvm {node.TEMPLATE}")
    assert (no_templates.returncode, no_templates.stderr) == \
        (255, "storage 'local-lvm' does not support templates\n")
    prerequisites.move_template_index(store)
    try:
        moved = store.ssh("pve1", "pveam available --section system").stdout
        assert node.NEWER_TEMPLATE in moved and node.TEMPLATE not in moved
        old = store.ssh("pve1", f"pveam download local {node.TEMPLATE}")
        assert old.returncode == 255 and "template: no such template" in old.stderr
        fetched = store.ssh("pve1", f"pveam download local {node.NEWER_TEMPLATE}")
        assert fetched.returncode == 0, fetched.stderr
        volumes = [r[0] for r in rows(store.ssh("pve1", "pveam list local").stdout)]
        assert volumes == [f"local:vztmpl/{node.NEWER_TEMPLATE}", TEMPLATE]  # what was there stays
    finally:
        files.template_index.write_text(json.dumps(node.TEMPLATE_INDEX))
        (files.template_cache / node.NEWER_TEMPLATE).unlink(missing_ok=True)


def test_the_tools_answer_at_their_absolute_paths_through_sudo(store):
    def as_user(command):
        return store.ssh("pve1", command, user=USER)

    for tool, command in (("/usr/sbin/pvesm", "status --content rootdir"),
                          ("/usr/bin/pveam", "available --section system"),
                          ("/usr/bin/pvesh", "get /cluster/resources --type vm --output-format json")):
        assert (as_user(f"{tool} {command}").returncode, as_user(f"{tool} {command}").stderr) == \
            (255, "please run as root\n")
        through_sudo = as_user(f"sudo -n {tool} {command}")
        assert through_sudo.returncode == 0, through_sudo.stderr
        assert through_sudo.stdout == store.ssh("pve1", f"{tool} {command}").stdout
    # The node comes from the session's sshd, not from what the caller passes (sudo drops it anyway).
    forged = as_user("PVESIM_STATE_DIR=/nonexistent PVESIM_NODE=pve9 sudo -n /usr/sbin/pvesm status")
    assert forged.returncode == 0 and "local-lvm" in forged.stdout
    assert [v["vmid"] for v in json.loads(as_user(
        "sudo -n /usr/bin/pvesh get /cluster/resources --type vm --output-format json").stdout)] == [420]


def test_production_s_pct_rule_alone_refuses_the_storage_tools(sim_factory):
    """sudoers.d/ansible_pct grants pct only: preflight and provision need sudoers.d/ansible_provision.
    A user of its own: sudo's rules are the machine's, and another sim up gives `ansible` the broad one."""
    user = "pct-only"
    s = sim_factory(nodes=1, containers=(430,), gpus=0, node_user=user)
    for tool in ("/usr/sbin/pvesm status", "/usr/bin/pveam available",
                 "/usr/bin/pvesh get /cluster/resources"):
        refused = s.ssh("pve1", f"sudo -n {tool}", user=user)
        assert refused.returncode == 1 and "a password is required" in refused.stderr, refused
    assert s.ssh("pve1", "sudo -n /usr/sbin/pct list", user=user).returncode == 0
