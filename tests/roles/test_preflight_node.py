"""playbooks/preflight_node.yml: a node's prerequisites as a checklist, checked against the settings the
node's training containers are created with. A good node passes every item; a node without nvidia-uvm,
with an old Proxmox VE, without the template or without NVIDIA's installer fails, naming the item and its
fix, while the other items still pass; so does a root disk storage without rootdir content, a container
still to create that does not fit, and a pinned template the index no longer lists. Once the index moves
on, the newest template is downloaded when asked, and only reported in check mode.
The faults are made in a small sim of this file's, one at a time (each undone), never in the session's."""

import json
import re
import subprocess

import pytest

import pvesim
from pvesim import driver, node, prerequisites
from pvesim.fleet import REPO, SIM_GROUP_VARS, VENV_BIN, ansible_env

pytestmark = pytest.mark.sim

ITEMS = ["pve-version", "nvidia-driver", "dkms", "secure-boot", "nvidia-uvm", "device-files",
         "fabric-manager", "template", "nvidia-installer", "rootdir-storage", "storage-room"]
TEMPLATE = "local:vztmpl/" + node.TEMPLATE
CHECKLIST_TASK = "Show the node's checklist."


def preflight_node(s, *args):
    res = subprocess.run([str(VENV_BIN / "ansible-playbook"), "-i", str(s.inventory_path), *args,
                          str(REPO / "playbooks" / "preflight_node.yml")], env=ansible_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    return res


def checklist(res, host="pve1"):
    """{item: (PASS or FAIL, the rest of its line)} of a host's checklist, as the play printed it."""
    block = res.stdout.split(f"TASK [dflash.ops.proxmox_host : {CHECKLIST_TASK}]", 1)[1]
    block = block.split(f"ok: [{host}] => ", 1)[1].split("\n}\n", 1)[0]
    lines = re.findall(r'^\s+"(PASS|FAIL) ([a-z-]+): (.*)",?$', block, re.M)
    return {item: (verdict, rest) for verdict, item, rest in lines}


@pytest.fixture(scope="module")
def node_sim(tmp_path_factory):
    """pve1 with CT 370 and one GPU, for the faults (each test undoes its own); the sim's group_vars name
    each container's node (proxmox_node), as an operator's inventory does."""
    base = tmp_path_factory.mktemp("node-faults")
    (base / "inventory").mkdir()
    (base / "inventory" / "group_vars").symlink_to(SIM_GROUP_VARS)
    s = pvesim.up(nodes=1, containers=(370,), gpus=1, state_dir=base / "state",
                  inventory=base / "inventory" / "hosts.yml")
    yield s
    pvesim.down(s.state_dir)


def test_a_good_node_passes_every_item(sim):
    res = preflight_node(sim)
    assert res.returncode == 0, res.stdout + res.stderr
    for host in ("pve1", "pve2"):
        items = checklist(res, host)
        assert list(items) == ITEMS, items
        assert {verdict for verdict, _ in items.values()} == {"PASS"}, items
        assert items["pve-version"][1] == "Proxmox VE 8.2.4 (needs 8.1+)"
        assert items["nvidia-driver"][1].startswith(f"driver {node.DRIVER_VERSION}, 8 GPU(s)")
        assert items["nvidia-installer"][1] == f"{installer(sim, host)} is there"


def installer(s, host="pve1"):
    return node.NodeFiles(s.state_dir, host).snippets / f"NVIDIA-Linux-x86_64-{node.DRIVER_VERSION}.run"


def template_file(s):
    return node.NodeFiles(s.state_dir, "pve1").template_cache / node.TEMPLATE


def fault_nvidia_uvm(s):
    prerequisites.set_nvidia_uvm(s, "pve1", loaded=False)
    return lambda: prerequisites.set_nvidia_uvm(s, "pve1", loaded=True)


def fault_device_nodes(s):
    # As after a boot that made none; the check looks before its nvidia-smi makes /dev/nvidiactl and
    # /dev/nvidia0 again (NVML does), and nothing of it makes CUDA's /dev/nvidia-uvm.
    prerequisites.remove_device_nodes(s, "pve1")
    return lambda: s.ssh("pve1", "nvidia-modprobe -c255 -c0 && nvidia-modprobe -u -c0")


# The boot unit as the README had it (nvidia-modprobe -c0 -u: only the uvm files), installed and enabled.
EARLIER_UNIT = """[Unit]
Before=pve-guests.service
[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=nvidia-modprobe -c0 -u
[Install]
WantedBy=multi-user.target
"""


def fault_earlier_unit(s):
    unit = "/etc/systemd/system/dflash-nvidia-devices.service"
    s.ssh("pve1", f"cat > {unit} <<'EOF'\n{EARLIER_UNIT}EOF\nsystemctl enable dflash-nvidia-devices")
    return lambda: s.ssh("pve1", f"systemctl disable dflash-nvidia-devices && rm {unit}")


def fault_old_version(s):
    prerequisites.set_pve_version(s, "pve1", "8.0.4/d258a813")
    return lambda: prerequisites.set_pve_version(s, "pve1", prerequisites.DEFAULT_VERSION)


def fault_no_template(s):
    template_file(s).unlink()
    return template_file(s).touch


def fault_no_installer(s):
    text = installer(s).read_text()
    installer(s).unlink()
    return lambda: installer(s).write_text(text)


def fault_no_dkms(s):
    driver.set_driver(s, "pve1", dkms=False)
    return lambda: driver.set_driver(s, "pve1", dkms=True)


def fault_secure_boot_key(s):
    driver.set_driver(s, "pve1", secure_boot=True, mok_enrolled=False)
    return lambda: driver.set_driver(s, "pve1", secure_boot=False)


@pytest.mark.parametrize("fault, item, found, fix", [
    (fault_nvidia_uvm, "nvidia-uvm", "lsmod lists no nvidia_uvm",
     "modprobe nvidia-uvm && nvidia-modprobe -u -c=0"),
    (fault_device_nodes, "device-files",
     "not a character device before this check ran nvidia-smi (test -c): /dev/nvidia0, /dev/nvidiactl, "
     "/dev/nvidia-uvm, /dev/nvidia-uvm-tools",
     "make them now: nvidia-modprobe -c255 -c0 && nvidia-modprobe -u -c0; and at every boot before the "
     "containers start: the unit dflash-nvidia-devices.service"),
    (fault_earlier_unit, "device-files",
     "the boot unit dflash-nvidia-devices.service: its ExecStart= lines make none of /dev/nvidia0, "
     "/dev/nvidiactl", "ExecStart=nvidia-modprobe -c255 -c0 and ExecStart=nvidia-modprobe -u -c0"),
    (fault_old_version, "pve-version", "Proxmox VE 8.0.4 (needs 8.1+)", "upgrade the node to Proxmox VE 8.1"),
    (fault_no_template, "template", f"{TEMPLATE} is not on storage local (pveam list local)",
     f"pveam download local {node.TEMPLATE}"),
    (fault_no_installer, "nvidia-installer", f"NVIDIA-Linux-x86_64-{node.DRIVER_VERSION}.run is missing",
     f"https://download.nvidia.com/XFree86/Linux-x86_64/{node.DRIVER_VERSION}/"),
    (fault_no_dkms, "dkms", "dkms is not installed, so the NVIDIA driver is built for the kernel it was "
     "installed under only", "apt install dkms proxmox-default-headers, then reinstall the driver: sh "
     f"NVIDIA-Linux-x86_64-{node.DRIVER_VERSION}.run --dkms --silent"),
    (fault_secure_boot_key, "secure-boot", "Secure Boot is on and DKMS's signing key is not enrolled",
     "mokutil --import /var/lib/dkms/mok.pub"),
], ids=["no-nvidia-uvm", "no-device-nodes", "earlier-boot-unit", "old-pve", "no-template", "no-installer",
        "no-dkms", "secure-boot-key-not-enrolled"])
def test_a_node_lacking_one_item_fails_naming_it_and_its_fix(node_sim, fault, item, found, fix):
    undo = fault(node_sim)
    try:
        res = preflight_node(node_sim)
    finally:
        undo()
    assert res.returncode != 0
    items = checklist(res)
    assert list(items) == ITEMS, items
    verdict, line = items[item]
    found_part, _, fix_part = line.partition(". Fix: ")
    assert verdict == "FAIL" and found in found_part and fix in fix_part, line
    # Each item stands on its own: the others pass (without nvidia-uvm loaded its device files are missing).
    failing = {item, "device-files"} if item == "nvidia-uvm" else {item}
    assert all(v == "PASS" for name, (v, _) in items.items() if name not in failing), items
    # The failure lists the items that fail, with their fixes, and no other.
    failure = res.stdout.split("Fail naming each prerequisite the node lacks and its fix.", 1)[1]
    assert f"FAIL {item}: " in failure and fix in failure
    assert not [name for name in ITEMS if name not in failing and f"FAIL {name}: " in failure]


def only_failure(res, item):
    """The line of the one item that fails (the others pass)."""
    items = checklist(res)
    assert res.returncode != 0 and [name for name, (v, _) in items.items() if v == "FAIL"] == [item], items
    return items[item][1]


def test_a_root_disk_storage_without_rootdir_content_fails_naming_the_one_that_has_it(node_sim):
    line = only_failure(preflight_node(node_sim, "-e", "proxmox_provision_rootfs_storage=local"),
                        "rootdir-storage")
    assert line.startswith("storage local holds no container root disks (pvesm status --content rootdir "
                           "lists local-lvm). Fix: put the root disks on a storage that holds them: "
                           "proxmox_provision_rootfs_storage: local-lvm"), line


def test_the_room_is_the_size_of_the_containers_still_to_create(node_sim, tmp_path):
    """CT 370 exists (its disk is counted as used); ct371, in the inventory only, needs its own size."""
    extra = tmp_path / "more.yml"
    extra.write_text(json.dumps({"all": {"children": {"training_containers": {"hosts": {"ct371": {
        "proxmox_vmid": 371, "proxmox_node": "pve1", "proxmox_provision_rootfs_size": 5000}}}}}}))
    line = only_failure(preflight_node(node_sim, "-i", str(extra)), "storage-room")
    assert re.match(r"storage local-lvm is active, \d+ GiB available \(needs 5000, for ct371\)\. Fix: ", line)
    extra.write_text(extra.read_text().replace("5000", "8"))
    assert preflight_node(node_sim, "-i", str(extra)).returncode == 0


def test_the_newest_template_is_downloaded_when_asked_and_a_stale_pin_fails(node_sim):
    files = node.NodeFiles(node_sim.state_dir, "pve1")
    newer = files.template_cache / node.NEWER_TEMPLATE
    prerequisites.move_template_index(node_sim)
    try:
        # The newest debian-12-standard is the newer one now, which the storage lacks.
        line = only_failure(preflight_node(node_sim), "template")
        assert line.startswith(f"local:vztmpl/{node.NEWER_TEMPLATE} is not on storage local"), line
        download = ("-e", "proxmox_host_prerequisites_download_template=true")
        check = preflight_node(node_sim, *download, "--check")
        assert check.returncode == 0, check.stdout
        assert "would be downloaded (pveam download local" in checklist(check)["template"][1]
        assert not newer.exists()
        res = preflight_node(node_sim, *download)
        assert res.returncode == 0, res.stdout
        downloaded = (f"local:vztmpl/{node.NEWER_TEMPLATE} downloaded "
                      f"(pveam download local {node.NEWER_TEMPLATE})")
        assert checklist(res)["template"] == ("PASS", downloaded)
        assert newer.exists()
        assert re.search(r"pve1\s+: ok=\d+\s+changed=1 ", res.stdout), res.stdout
        # A pin the index no longer lists fails, naming what it lists (the old file is still on the storage).
        pin = ("-e", f"proxmox_provision_template={TEMPLATE}")
        pinned = only_failure(preflight_node(node_sim, *pin), "template")
        assert pinned.startswith(f"{TEMPLATE} (pinned by proxmox_provision_template for ct370) is not in the "
                                 "node's index; pveam available --section system lists: "), pinned
        assert node.NEWER_TEMPLATE in pinned and "Fix: pin one of those" in pinned
    finally:
        files.template_index.write_text(json.dumps(node.TEMPLATE_INDEX))
        newer.unlink(missing_ok=True)


def test_an_nvswitch_board_needs_the_fabric_manager_of_the_driver_s_version_running(sim_factory):
    s = sim_factory(nodes=1, containers=(372,), gpus=2, nvswitch=True)
    res = preflight_node(s)
    assert res.returncode == 0, res.stdout
    assert checklist(res)["fabric-manager"] == (
        "PASS", f"nvidia-fabricmanager.service active, version {node.DRIVER_VERSION}, fabric Completed")

    prerequisites.set_fabric_manager(s, "pve1", "550.90.07", running=False)
    verdict, line = checklist(preflight_node(s))["fabric-manager"]
    assert verdict == "FAIL" and line.startswith(
        f"nv-fabricmanager 550.90.07 is not the driver's version {node.DRIVER_VERSION} (CUDA fails with "
        f"error 802, system not yet initialized). Fix: install NVIDIA Fabric Manager of the driver's version "
        f"{node.DRIVER_VERSION} (nvidia-fabricmanager-550={node.DRIVER_VERSION}"), line

    # The driver's version, but not enabled: after a reboot it does not run and the fabric waits.
    prerequisites.set_fabric_manager(s, "pve1", node.DRIVER_VERSION, running=False, enabled=False)
    s.reboot_node("pve1")
    items = checklist(preflight_node(s))
    assert items["fabric-manager"] == (
        "FAIL", "nvidia-fabricmanager.service is inactive (CUDA fails with error 802, system not yet "
        "initialized). Fix: systemctl enable --now nvidia-fabricmanager.service; journalctl -u "
        "nvidia-fabricmanager.service and /var/log/fabricmanager.log say why it stopped"), items
    # nvidia-smi lists every GPU anyway: the driver item passes.
    assert items["nvidia-driver"] == ("PASS", f"driver {node.DRIVER_VERSION}, 2 GPU(s)")


def test_an_a100_nvswitch_board_without_a_fabric_section_still_needs_its_fabric_manager(sim_factory):
    """An A100's nvidia-smi -q has no Fabric section: lspci's NVSwitches say the board needs Fabric
    Manager (CUDA fails with 802 without it)."""
    s = sim_factory(nodes=1, containers=(374,), gpus=2, nvswitch=True, gpu_generation="ampere")
    board = "A100-class NVSwitch board (6 NVSwitches in lspci, no fabric state in nvidia-smi -q)"
    assert checklist(preflight_node(s))["fabric-manager"] == (
        "PASS", f"nvidia-fabricmanager.service active, version {node.DRIVER_VERSION}, on an {board}")
    prerequisites.set_fabric_manager(s, "pve1", None)
    verdict, line = checklist(preflight_node(s))["fabric-manager"]
    assert verdict == "FAIL" and line.startswith(
        f"{board} without nv-fabricmanager (CUDA fails with error 802, system not yet initialized). Fix: "
        f"install NVIDIA Fabric Manager of the driver's version {node.DRIVER_VERSION}"), line
