# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A Proxmox VE node's NVIDIA items of proxmox_node_check: the device files the containers pass through,
and on NVSwitch (HGX) boards the fabric manager.

Device files: no NVIDIA device node exists after a boot until the user-space driver makes it
(nvidia-modprobe, nvidia-smi, a CUDA program; NVIDIA's driver README, "How and when are the NVIDIA device
files created?"), and pve-container refuses a devN path that does not exist at create and at every start
("Device /dev/nvidia-uvm does not exist", LXC/Tools.pm get_device_mode_and_rdev), the onboot start after a
reboot included. Fabric manager: on an NVSwitch board CUDA fails with error 802 ("system not yet
initialized") until NVIDIA Fabric Manager of the driver's exact version has set the fabric up (NVIDIA
Fabric Manager user guide); nvidia-smi lists the GPUs either way, and `nvidia-smi -q` shows the fabric's
State (In Progress, Completed) and Status.
"""

from __future__ import annotations

import os
import re
import stat

# The unit the proxmox_host role installs (tasks/boot_devices.yml) to make the device nodes at each boot,
# before pve-guests.service starts the onboot containers.
DEVICE_UNIT = "dflash-nvidia-devices.service"
FABRIC_UNIT = "nvidia-fabricmanager.service"
CONTROL_FILES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
FM_VERSION = re.compile(r"Fabric Manager version is\s*:\s*(\S+)")


def device_files(minor_numbers, extra=CONTROL_FILES):
    """The device files a GPU container needs: each GPU's /dev/nvidiaN, the control and CUDA's."""
    return [f"/dev/nvidia{m}" for m in sorted(set(minor_numbers))] + list(extra)


def is_char_device(path):
    """`test -c path`: the path exists and is a character device."""
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def check_device_files(check, paths, exists=is_char_device):
    missing = [p for p in paths if not exists(p)]
    gpus = sorted(int(p[len("/dev/nvidia"):]) for p in paths if re.fullmatch(r"/dev/nvidia[0-9]+", p))
    fix = ("make them now: nvidia-modprobe -c0 -u" + "".join(f" && nvidia-modprobe -c{m}" for m in gpus if m)
           + f"; and at every boot before the containers start: the unit {DEVICE_UNIT} "
           "(ansible-playbook playbooks/provision.yml installs it; the README's node section has it), else "
           "pct start fails with \"Device /dev/nvidia-uvm does not exist\"")
    if not paths:
        return check("device-files", False, "no device file to check (no GPU listed by nvidia-smi)",
                     "fix nvidia-driver first")
    if missing:
        return check("device-files", False, f"not a character device (test -c): {', '.join(missing)}", fix)
    return check("device-files", True, f"{len(paths)} device files present ({', '.join(paths)})", fix)


def parse_fabric(report):
    """[(State, Status)] of each GPU's Fabric section in `nvidia-smi -q`."""
    found, section, current = [], None, {}
    for line in report.splitlines():
        stripped = line.strip()
        if stripped == "Fabric":
            section, current = "fabric", {}
            found.append(current)
        elif section == "fabric" and ":" in stripped and line.startswith(" " * 8):
            key, _sep, value = stripped.partition(":")
            current[key.strip()] = value.strip()
        elif stripped and not line.startswith(" " * 8):
            section = None
    return [(f.get("State", "N/A"), f.get("Status", "N/A")) for f in found]


def check_fabric_manager(check, tools, query_report, driver_version):
    """The fabric-manager item: not needed without NVSwitches (every GPU's Fabric State N/A); on an
    NVSwitch board its unit active, its version the driver's, every GPU's fabric Completed."""
    if query_report is None:
        return check("fabric-manager", False, "nvidia-smi -q gives no report", "fix nvidia-driver first")
    fabrics = parse_fabric(query_report)
    if all(state in ("N/A", "Not Supported") for state, _kind in fabrics):
        return check("fabric-manager", True, "not needed: no NVSwitch fabric (nvidia-smi -q: Fabric State "
                     "N/A)", "")
    active = tools.tool("systemctl", "is-active", FABRIC_UNIT, as_root=False)
    version = tools.tool("nv-fabricmanager", "--version", as_root=False)
    match = FM_VERSION.search(version.stdout or "") if version.rc == 0 else None
    fm_version = match.group(1) if match else None
    states = sorted({f"{state}/{status}" for state, status in fabrics})
    install = (f"install NVIDIA Fabric Manager of the driver's version {driver_version} "
               f"(nvidia-fabricmanager-{(driver_version or 'X').split('.')[0]}={driver_version}, or the "
               f"fabricmanager archive of {driver_version}) and systemctl enable --now {FABRIC_UNIT}")
    if fm_version is None:
        found, fix = "NVSwitch board without nv-fabricmanager", install
    elif fm_version != driver_version:
        found = f"nv-fabricmanager {fm_version} is not the driver's version {driver_version}"
        fix = install
    elif (active.stdout or "").strip() != "active":
        found = f"{FABRIC_UNIT} is {(active.stdout or '').strip() or 'not active'}"
        fix = (f"systemctl enable --now {FABRIC_UNIT}; journalctl -u {FABRIC_UNIT} and "
               "/var/log/fabricmanager.log say why it stopped")
    elif states != ["Completed/Success"]:
        found, fix = (f"the GPUs' fabric is {', '.join(states)} (nvidia-smi -q)",
                      f"wait for the fabric manager to finish, else systemctl restart {FABRIC_UNIT}")
    else:
        return check("fabric-manager", True, f"{FABRIC_UNIT} active, version {fm_version}, fabric "
                     "Completed", "")
    return check("fabric-manager", False, found + " (CUDA fails with error 802, system not yet initialized)",
                 fix)
