# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A Proxmox VE node's NVIDIA items of proxmox_node_check: the device files the containers pass through,
and on NVSwitch (HGX) boards the fabric manager.

Device files: no NVIDIA device node exists after a boot until the user-space driver makes it
(nvidia-modprobe, nvidia-smi, a CUDA program; NVIDIA's driver README, "How and when are the NVIDIA device
files created?"), and pve-container refuses a devN path that does not exist at create and at every start
("Device /dev/nvidia0 does not exist", LXC/Tools.pm get_device_mode_and_rdev), the onboot start after a
reboot included. NVML (nvidia-smi) makes /dev/nvidiactl and every /dev/nvidiaN when it runs, so the files
are looked at before anything of the check runs it; nvidia-modprobe makes only the files of the minors
it is given (NVIDIA/nvidia-modprobe, nvidia-modprobe.c main(): without -u, -cN makes /dev/nvidiaN and
-c255 /dev/nvidiactl, assign_device_file_name; with -u, -cN makes /dev/nvidia-uvm of minor N and
/dev/nvidia-uvm-tools of N + 1, nvidia_uvm_mknod), which is how the boot unit's lines are judged.
Fabric manager: on an NVSwitch board CUDA fails with error 802 ("system not yet initialized") until NVIDIA
Fabric Manager of the driver's exact version has set the fabric up (NVIDIA Fabric Manager user guide);
nvidia-smi lists the GPUs either way, and `nvidia-smi -q` shows the fabric's State (In Progress,
Completed) and Status on Hopper and later.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import stat

# The unit the proxmox_host role installs (tasks/boot_devices.yml) to make the device nodes at each boot,
# before pve-guests.service starts the onboot containers.
DEVICE_UNIT = "dflash-nvidia-devices.service"
UNIT_DIR = "/etc/systemd/system"
GUESTS_UNIT = "pve-guests.service"
FABRIC_UNIT = "nvidia-fabricmanager.service"
CONTROL_FILES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
CTL_MINOR = 255
NO_FABRIC = ("N/A", "Not Supported")
# lspci -d: NVIDIA's vendor id, any device, PCI class 0680 (Bridge: other), which an NVSwitch is.
NVSWITCH_PCI = "10de::0680"
FM_VERSION = re.compile(r"Fabric Manager version is\s*:\s*(\S+)")
MODPROBE_MINOR = re.compile(r"(?:-c|--create-nvidia-device-file)(?:=?)(\S*)")


def device_files(minor_numbers, extra=CONTROL_FILES):
    """The device files a GPU container needs: each GPU's /dev/nvidiaN, the control and CUDA's."""
    return [f"/dev/nvidia{m}" for m in sorted(set(minor_numbers))] + list(extra)


def is_char_device(path):
    """`test -c path`: the path exists and is a character device."""
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def present_files(exists=is_char_device):
    """The NVIDIA device files there now: read before anything runs nvidia-smi, which makes some."""
    return {path for path in glob.glob("/dev/nvidia*") if exists(path)}


def modprobe_minors(argv):
    """(the -c minors, the flags) of an nvidia-modprobe command line, read as nvgetopt reads them
    (`-c N`, `-cN`, `-c=N`, `--create-nvidia-device-file[=]N`, flags run together as in `-um`); None
    when a minor is not a number."""
    minors, flags, i = [], set(), 0
    while i < len(argv):
        arg = argv[i]
        match = MODPROBE_MINOR.fullmatch(arg)
        if match:
            value = match.group(1)
            if not value:
                i += 1
                value = argv[i] if i < len(argv) else ""
            try:
                minors.append(int(value, 0))
            except ValueError:
                return None
        elif re.fullmatch(r"-[a-z]+", arg):
            flags.update(arg[1:])
        elif arg.startswith("--"):
            flags.add({"--unified-memory": "u", "--modeset": "m", "--nvswitch": "s",
                       "--nvlink": "l"}.get(arg, arg))
        i += 1
    return minors, flags


def files_made_by(argv, gpu_minors):
    """The device files a command of the boot unit makes: `nvidia-modprobe` as its main() does (the first
    of -l, -s, -u decides; without them each -cN makes /dev/nvidiaN, /dev/nvidiactl for 255; with -u each
    -cN /dev/nvidia-uvm and, of minor N + 1, /dev/nvidia-uvm-tools, which -c0 gives their right minors),
    `nvidia-smi` as NVML does (/dev/nvidiactl and every GPU's); nothing for another command."""
    program = os.path.basename(argv[0]) if argv else ""
    if program == "nvidia-smi":
        return {"/dev/nvidiactl"} | {f"/dev/nvidia{m}" for m in gpu_minors}
    read = modprobe_minors(argv[1:]) if program == "nvidia-modprobe" else None
    if read is None:
        return set()
    minors, flags = read
    if flags & {"l", "s"}:
        return set()
    if "u" in flags:
        return {"/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"} if 0 in minors else set()
    return {"/dev/nvidiactl" if m == CTL_MINOR else f"/dev/nvidia{m}" for m in minors if 0 <= m <= CTL_MINOR}


def unit_lines(text):
    """{key: [values]} of a unit file's lines (every section), comments left out."""
    found = {}
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and not key.startswith(("#", ";")):
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def unit_problems(text, paths, gpu_minors, enabled):
    """What keeps the boot unit from making `paths` before the onboot containers start: [] when nothing."""
    lines = unit_lines(text)
    made = set()
    for command in lines.get("ExecStart", []):
        try:
            made |= files_made_by(shlex.split(command.lstrip("-@+!:")), gpu_minors)
        except ValueError:
            continue
    problems = []
    missing = [p for p in paths if p not in made]
    if missing:
        problems.append(f"its ExecStart= lines make none of {', '.join(missing)}")
    if GUESTS_UNIT not in " ".join(lines.get("Before", [])).split():
        problems.append(f"it is not ordered Before={GUESTS_UNIT}")
    if not enabled:
        problems.append("it is not enabled")
    return problems


def read_unit(unit_dir=UNIT_DIR):
    """(the boot unit's text or None, whether multi-user.target wants it)."""
    try:
        with open(os.path.join(unit_dir, DEVICE_UNIT)) as fh:
            text = fh.read()
    except OSError:
        return None, False
    return text, os.path.exists(os.path.join(unit_dir, "multi-user.target.wants", DEVICE_UNIT))


def make_commands(gpu_minors):
    """The two commands that make every file a GPU container passes through."""
    return [f"nvidia-modprobe -c{CTL_MINOR} " + " ".join(f"-c{m}" for m in sorted(set(gpu_minors))),
            "nvidia-modprobe -u -c0"]


def check_device_files(check, paths, present, unit=(None, False)):
    """The device-files item: each of `paths` was there before the check ran anything (`present`), and the
    boot unit, where it is installed (`unit`: read_unit's), makes each at boot before the guests start."""
    gpus = sorted(int(p[len("/dev/nvidia"):]) for p in paths if re.fullmatch(r"/dev/nvidia[0-9]+", p))
    commands = make_commands(gpus)
    fix = (f"make them now: {' && '.join(commands)}; and at every boot before the containers start: the unit "
           f"{DEVICE_UNIT} with ExecStart={commands[0]} and ExecStart={commands[1]}, Before={GUESTS_UNIT} "
           "(ansible-playbook playbooks/provision.yml installs it; the README's node section has it), else "
           "pct start fails with \"Device /dev/nvidia0 does not exist\"")
    if not paths:
        return check("device-files", False, "no device file to check (no GPU listed by nvidia-smi)",
                     "fix nvidia-driver first")
    missing = [p for p in paths if p not in present]
    text, enabled = unit
    problems = unit_problems(text, paths, gpus, enabled) if text is not None else []
    if missing or problems:
        found = [f"not a character device before this check ran nvidia-smi (test -c): {', '.join(missing)}"
                 ] if missing else []
        found += [f"the boot unit {DEVICE_UNIT}: {'; '.join(problems)}"] if problems else []
        return check("device-files", False, "; ".join(found), fix)
    boot = (f"{DEVICE_UNIT} makes them at boot" if text is not None else
            f"{DEVICE_UNIT} not installed yet (provision.yml installs it): none of them is there after a "
            "reboot")
    return check("device-files", True, f"{len(paths)} device files present ({', '.join(paths)}); {boot}", fix)


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


def nvswitch_count(tools):
    """The NVSwitches lspci sees (NVIDIA devices of PCI class 0680, Bridge: an HGX board's), None when
    lspci cannot be run."""
    answer = tools.tool("lspci", "-n", "-d", NVSWITCH_PCI, as_root=False)
    if answer.rc != 0:
        return None
    return len([line for line in (answer.stdout or "").splitlines() if line.strip()])


def check_fabric_manager(check, tools, query_report, driver_version):
    """The fabric-manager item: on an NVSwitch board its unit active, its version the driver's and, where
    `nvidia-smi -q` has a fabric state (Hopper and later), every GPU's fabric Completed. An A100-class board
    has no Fabric section: its NVSwitches are seen by lspci. Not needed where neither shows one."""
    if query_report is None:
        return check("fabric-manager", False, "nvidia-smi -q gives no report", "fix nvidia-driver first")
    fabrics = [(state, status) for state, status in parse_fabric(query_report) if state not in NO_FABRIC]
    board = "NVSwitch board"
    if not fabrics:
        switches = nvswitch_count(tools)
        if switches is None:
            return check("fabric-manager", False, "cannot tell whether the board has NVSwitches: nvidia-smi "
                         f"-q shows no fabric state and lspci -n -d {NVSWITCH_PCI} fails",
                         "apt install pciutils (lspci)")
        if not switches:
            return check("fabric-manager", True, "not needed: no NVSwitch (nvidia-smi -q: no fabric state; "
                         f"lspci -d {NVSWITCH_PCI}: none)", "")
        board = (f"A100-class NVSwitch board ({switches} NVSwitches in lspci, no fabric state in "
                 "nvidia-smi -q)")
    active = tools.tool("systemctl", "is-active", FABRIC_UNIT, as_root=False)
    version = tools.tool("nv-fabricmanager", "--version", as_root=False)
    match = FM_VERSION.search(version.stdout or "") if version.rc == 0 else None
    fm_version = match.group(1) if match else None
    states = sorted({f"{state}/{status}" for state, status in fabrics})
    install = (f"install NVIDIA Fabric Manager of the driver's version {driver_version} "
               f"(nvidia-fabricmanager-{(driver_version or 'X').split('.')[0]}={driver_version}, or the "
               f"fabricmanager archive of {driver_version}) and systemctl enable --now {FABRIC_UNIT}")
    if fm_version is None:
        found, fix = f"{board} without nv-fabricmanager", install
    elif fm_version != driver_version:
        found = f"nv-fabricmanager {fm_version} is not the driver's version {driver_version}"
        fix = install
    elif (active.stdout or "").strip() != "active":
        found = f"{FABRIC_UNIT} is {(active.stdout or '').strip() or 'not active'}"
        fix = (f"systemctl enable --now {FABRIC_UNIT}; journalctl -u {FABRIC_UNIT} and "
               "/var/log/fabricmanager.log say why it stopped")
    elif fabrics and states != ["Completed/Success"]:
        found, fix = (f"the GPUs' fabric is {', '.join(states)} (nvidia-smi -q)",
                      f"wait for the fabric manager to finish, else systemctl restart {FABRIC_UNIT}")
    elif fabrics:
        return check("fabric-manager", True, f"{FABRIC_UNIT} active, version {fm_version}, fabric "
                     "Completed", "")
    else:
        return check("fabric-manager", True, f"{FABRIC_UNIT} active, version {fm_version}, on an {board}", "")
    return check("fabric-manager", False, found + " (CUDA fails with error 802, system not yet initialized)",
                 fix)
