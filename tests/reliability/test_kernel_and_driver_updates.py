"""A node's driver update and kernel update, end to end on pvesim from docs/OPERATIONS.md's commands
("Kernel and driver updates"): NVIDIA's installer of a new version run on the node as the doc says moves
its kernel module, a container provisioned before then fails NVML (exit 18, NVIDIA's words), `gpu_verify`
names the mismatch and provision.yml, and provision.yml brings the container's user space to the node's
version; a node whose driver was installed without DKMS fails the preflight's `dkms` item before its kernel
update, boots the new kernel without a driver, and once the driver is reinstalled as the fix says, the next
kernel comes with its module.

pvesim's stand-ins: `driver.put_installer` for the download to the storage's snippets, `driver.install_dkms`
for `apt install dkms proxmox-default-headers`, `driver.kernel_update` for `apt full-upgrade`,
`Sim.reboot_node` for `reboot`. pve1 with 2 GPUs: CT 200 (GPU 0) and CT 201 (GPU 1, made by provision.yml)."""

import re
import shlex

import pytest

from pvesim import driver
from pvesim.driver import DEFAULT_KERNEL
from pvesim.fleet import REPO, Fleet, run_module
from pvesim.node import DRIVER_VERSION

pytestmark = [pytest.mark.sim, pytest.mark.slow, pytest.mark.reliability_full]

NEW_DRIVER = "550.144.03"
NEW = 201
SECTION = "Kernel and driver updates"


def doc_commands():
    """Every command of the sh blocks of docs/OPERATIONS.md's section (comments dropped)."""
    text = (REPO / "docs" / "OPERATIONS.md").read_text()
    body = re.search(rf"^## {SECTION}\n(.*?)(?=^## )", text, re.M | re.S).group(1)
    return [line.split("   #")[0].strip() for block in re.findall(r"```sh\n(.*?)```", body, re.S)
            for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def doc_command(start):
    [found] = [command for command in doc_commands() if command.startswith(start)]
    return found


def on_node(fleet, command, rc=0):
    res = fleet.sim.ssh("pve1", command)
    assert res.returncode == rc, f"{command}: {res.returncode} {res.stdout} {res.stderr}"
    return res


def node_checks(fleet):
    """{item: check} of the node's checklist, as playbooks/preflight_node.yml's module returned it."""
    res = fleet.play("preflight_node.yml")
    [task] = [t for t in res.tasks if t.action == "dflash.ops.proxmox_node_check"]
    return {c["item"]: c for c in task.hosts["pve1"]["checks"]}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("driver-updates"), nodes=1, containers=(200,), gpus=2,
              gpu_passthrough={200: [0]})
    f.add_to_inventory("pve1", NEW, proxmox_provision_gpus=[1], proxmox_provision_cores=2,
                       proxmox_provision_memory=4096, proxmox_provision_rootfs_size=8)
    yield f
    f.down()


def test_after_a_driver_update_the_container_s_mismatch_is_named_and_provision_yml_fixes_it(fleet):
    provision = shlex.split(doc_command("ansible-playbook -i inventory/production playbooks/provision.yml"))
    assert provision[-1] == "playbooks/provision.yml"
    assert fleet.play("provision.yml", "-l", f"ct{NEW}").rc == 0
    assert fleet.ct(NEW, "nvidia-smi --query-gpu=driver_version --format=csv,noheader").stdout == \
        f"{DRIVER_VERSION}\n"

    driver.put_installer(fleet.sim, "pve1", NEW_DRIVER)
    install = doc_command('sh "$(pvesm path local:snippets/NVIDIA-Linux-x86_64-<version>.run)"')
    assert "is now complete" in on_node(fleet, install.replace("<version>", NEW_DRIVER)).stdout
    seen = fleet.ct(NEW, "nvidia-smi --query-gpu=driver_version --format=csv,noheader")
    assert (seen.returncode, seen.stdout) == (
        18, "Failed to initialize NVML: Driver/library version mismatch\nNVML library version: 550.127\n")
    verify = run_module("dflash.ops.gpu_verify", {"expect": "present"}, fleet.inventory, f"ct{NEW}")
    message = next(verify.host_results())[2]["msg"]
    assert "version mismatch (exit 18)" in message, message
    assert "ansible-playbook playbooks/provision.yml" in message, message

    assert fleet.play("provision.yml", "-l", f"ct{NEW}").rc == 0
    assert fleet.ct(NEW, "nvidia-smi --query-gpu=driver_version --format=csv,noheader").stdout == \
        f"{NEW_DRIVER}\n"


def test_a_kernel_update_without_dkms_is_named_before_and_after_its_reboot_and_the_fix_holds(fleet):
    driver.set_driver(fleet.sim, "pve1", dkms=False)  # a node set up without the dkms package
    before = node_checks(fleet)["dkms"]
    assert not before["ok"] and before["found"].startswith("dkms is not installed"), before
    assert "apt install dkms proxmox-default-headers" in before["fix"] and "--dkms" in before["fix"]

    new_kernel = driver.kernel_update(fleet.sim, "pve1")  # apt full-upgrade
    fleet.sim.reboot_node("pve1")
    assert "nvidia" not in on_node(fleet, "lsmod").stdout
    after = node_checks(fleet)
    assert not after["nvidia-driver"]["ok"]
    assert "cannot reach the NVIDIA driver" in after["nvidia-driver"]["found"]
    assert not after["dkms"]["ok"] and new_kernel in after["dkms"]["found"]

    # The fix: dkms installed, the driver reinstalled with the doc's command, which registers it.
    driver.install_dkms(fleet.sim, "pve1")
    installed = driver.node_state(fleet.sim, "pve1")["driver"]
    driver.put_installer(fleet.sim, "pve1", installed)
    install = doc_command('sh "$(pvesm path local:snippets/NVIDIA-Linux-x86_64-<version>.run)"')
    on_node(fleet, install.replace("<version>", installed))
    # The installer built the module for the running kernel; the kernel before it is named with its fix.
    old = node_checks(fleet)["dkms"]
    assert not old["ok"] and old["found"].startswith(f"nvidia {installed} is not installed by DKMS for "
                                                     f"kernel(s) {DEFAULT_KERNEL}"), old
    on_node(fleet, old["fix"].split(", then ", 1)[1])  # pvesim's kernels have their headers
    assert node_checks(fleet)["dkms"]["ok"]

    next_kernel = driver.kernel_update(fleet.sim, "pve1")
    listed = on_node(fleet, doc_command("dkms status")).stdout
    assert f"nvidia/{installed}, {next_kernel}, x86_64: installed" in listed
    fleet.sim.reboot_node("pve1")
    assert "nvidia " in on_node(fleet, "lsmod").stdout
    checks = node_checks(fleet)
    assert checks["nvidia-driver"]["ok"] and checks["dkms"]["ok"], checks
