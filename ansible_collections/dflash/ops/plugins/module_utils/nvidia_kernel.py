# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A Proxmox VE node's NVIDIA kernel module across kernel updates: proxmox_node_check's `dkms` and
`secure-boot` items.

NVIDIA's `.run` installer builds nvidia.ko for the kernel it runs under. Registered with DKMS (the
installer does so when the dkms package is installed: `dkms_register_module`, default yes, `--dkms`), the
module is rebuilt by DKMS's kernel hook for every proxmox-kernel `apt full-upgrade` installs later;
without it the next kernel has no nvidia.ko, and after the reboot into it there is no driver, no device
file and no GPU container start ("Device /dev/nvidia0 does not exist"). Under UEFI Secure Boot (PVE 8.1+)
the kernel loads only a module signed by a key it trusts: DKMS signs with /var/lib/dkms/mok.key, whose
certificate must be enrolled in shim's MOK list.

Readers of the tools' answers: dpkg-query's `${Package} ${Status}` lines, dkms 3.x's `dkms status`
(`<module>/<version>, <kernel>, <arch>: <state>`; dkms 2.x wrote `<module>, <version>, ...`), mokutil's
`--sb-state` ("SecureBoot enabled"/"disabled") and `--test-key` ("... is already enrolled").
"""

from __future__ import annotations

import re

KERNEL_PATTERN = "proxmox-kernel-*"
# A kernel image package (PVE 8's `proxmox-kernel-6.8.12-4-pve-signed`, or the unsigned one); not the
# series' meta package (`proxmox-kernel-6.8`) nor `proxmox-kernel-helper`.
KERNEL_PACKAGE = re.compile(r"^proxmox-kernel-(\d+\.\d+\.\d+-\d+-pve)(?:-signed)?$")
INSTALLED = "install ok installed"
DKMS_LINE = re.compile(r"^(?P<module>[^/,\s]+)(?:/|, )(?P<version>[^,:\s]+), (?P<kernel>[^,\s]+), "
                       r"(?P<arch>[^:\s]+): (?P<state>[a-z-]+)")
MODULE = "nvidia"
MOK_PUB = "/var/lib/dkms/mok.pub"
DOCS = "docs/OPERATIONS.md, \"Kernel and driver updates\""


def kernel_key(version):
    return tuple(int(n) for n in re.findall(r"\d+", version))


def installed_kernels(dpkg_output):
    """The kernel versions of the installed proxmox-kernel image packages, oldest first, from
    `dpkg-query -W -f '${Package} ${Status}\\n' 'proxmox-kernel-*'`."""
    kernels = set()
    for line in dpkg_output.splitlines():
        package, _sep, status = line.strip().partition(" ")
        match = KERNEL_PACKAGE.match(package)
        if match and status.strip() == INSTALLED:
            kernels.add(match.group(1))
    return sorted(kernels, key=kernel_key)


def dkms_kernels(dkms_output, module=MODULE):
    """{version: [kernels it is installed for]} of `module` in `dkms status`."""
    found = {}
    for line in dkms_output.splitlines():
        match = DKMS_LINE.match(line.strip())
        if match and match.group("module") == module and match.group("state") == "installed":
            found.setdefault(match.group("version"), []).append(match.group("kernel"))
        elif line.strip().startswith(f"{module}/") and line.strip().endswith(": added"):
            found.setdefault(line.strip()[len(module) + 1:-len(": added")], [])
    return found


def reinstall_fix(version):
    run = f"NVIDIA-Linux-x86_64-{version or '<version>'}.run"
    return ("register the driver with DKMS, so that each new kernel gets its nvidia.ko: apt install dkms "
            f"proxmox-default-headers, then reinstall the driver: sh {run} --dkms --silent (stop the runs "
            f"first); {DOCS}")


def check_dkms(check, tools, driver_version):
    """The dkms item: the driver's module is installed by DKMS for every installed proxmox-kernel."""
    listing = tools.tool("dpkg-query", "-W", "-f", "${Package} ${Status}\\n", KERNEL_PATTERN, as_root=False)
    kernels = installed_kernels(listing.stdout or "") if listing.rc == 0 else []
    if not kernels:
        said = (listing.stderr or "").strip() or "no output"
        return check("dkms", False, f"dpkg-query lists no installed {KERNEL_PATTERN} package ({said})",
                     "run this on a Proxmox VE node (is the node's ansible_host its address?)")
    listed = ", ".join(kernels)
    status = tools.tool("dkms", "status", as_root=False)
    if status.rc is None or status.rc in (126, 127):
        return check("dkms", False, "dkms is not installed, so the NVIDIA driver is built for the kernel it "
                     "was installed under only: the next kernel update leaves the node without nvidia.ko "
                     f"(installed kernels: {listed})", reinstall_fix(driver_version))
    registered = dkms_kernels(status.stdout or "")
    if not registered:
        return check("dkms", False, "dkms status lists no nvidia module: the driver was installed without "
                     "DKMS and has nvidia.ko for the kernel it was installed under only; after a kernel "
                     f"update and a reboot the node has no NVIDIA driver (installed kernels: {listed})",
                     reinstall_fix(driver_version))
    version = driver_version if driver_version in registered else max(registered, key=kernel_key)
    if version != driver_version and driver_version is not None:
        return check("dkms", False, f"DKMS has nvidia {', '.join(sorted(registered))}, not the running "
                     f"driver {driver_version}", reinstall_fix(driver_version))
    missing = [k for k in kernels if k not in registered[version]]
    if missing:
        built = ", ".join(registered[version]) or "none"
        fix = " && ".join(f"dkms install {MODULE}/{version} -k {k}" for k in missing)
        return check("dkms", False, f"nvidia {version} is not installed by DKMS for kernel(s) "
                     f"{', '.join(missing)} (dkms status lists it for {built}): booting one leaves the node "
                     "without its NVIDIA driver",
                     f"apt install {' '.join(f'proxmox-headers-{k}' for k in missing)}, then {fix}")
    return check("dkms", True, f"nvidia {version} installed by DKMS for every installed kernel ({listed})",
                 "")


def secure_boot_state(output):
    """True, False, or None when mokutil gave neither line ("EFI variables are not supported": a BIOS
    boot, no Secure Boot)."""
    for line in output.splitlines():
        if line.strip() == "SecureBoot enabled":
            return True
        if line.strip() == "SecureBoot disabled":
            return False
    return None


def check_secure_boot(check, tools):
    """The secure-boot item: under Secure Boot, DKMS's signing key is enrolled (else the kernel refuses
    the module DKMS built: "Key was rejected by service")."""
    answer = tools.tool("mokutil", "--sb-state", as_root=False)
    said = f"{answer.stdout or ''} {answer.stderr or ''}".strip()
    state = None if answer.rc in (None, 126, 127) else secure_boot_state(answer.stdout or "")
    if not state:
        why = ("Secure Boot is off" if state is False else
               f"no Secure Boot state ({said or 'mokutil missing'})")
        return check("secure-boot", True, f"not needed: {why}", "")
    key = tools.tool("mokutil", "--test-key", MOK_PUB, as_root=False)
    enrolled = key.rc == 0 and "is already enrolled" in (key.stdout or "")
    fix = (f"enrol DKMS's signing key: mokutil --import {MOK_PUB} (choose a one-time password), reboot, "
           "and at the console's MOK manager choose Enroll MOK with that password; or turn Secure Boot off "
           f"in the firmware; {DOCS}")
    if enrolled:
        return check("secure-boot", True, f"Secure Boot is on and DKMS's signing key {MOK_PUB} is enrolled",
                     fix)
    found = f"{(key.stdout or '').strip() or (key.stderr or '').strip() or 'mokutil --test-key fails'}"
    return check("secure-boot", False, f"Secure Boot is on and DKMS's signing key is not enrolled ({found}): "
                 "the kernel refuses to load nvidia.ko", fix)
