"""The container config of pvesim's pct, as pve-container's src/PVE/LXC/Config.pm knows it: the file's
format (parse_pct_config, write_pct_config), its `lock:` and the config's file lock (pve-guest-common's
AbstractConfig.pm), the options `pct create` and `pct set` take and how the API's schema checks them, the
devices a config passes through (with what a start makes of them, LXC.pm and LXC/Tools.pm), and whether
the HA manager manages a container (pve-ha-manager's HA/Config.pm). Beside pvesim/bin/pct, which imports it
from its own directory, and copied beside a node's pvesm and vzdump; standard library only, like pct,
which runs under the machine's python3 outside any virtual environment.
"""

import contextlib
import fcntl
import json
import os
import re
import time

# A failure is a Perl `die` out of the CLI handler: the message on stderr, and the exit status is errno
# when a system call failed just before (2, ENOENT, after a stat of a missing file), else 255.
EXIT_ERROR = 255
EXIT_ENOENT = 2
GPU_DEVICE = re.compile(r"^/dev/nvidia([0-9]+)$")
MOUNT_POINT = re.compile(r"mp[0-9]+")
TRUE_WORDS = ("1", "yes", "true", "on")
CONTROL_DEVICE = "/dev/nvidiactl"


class PctError(Exception):
    """A failure reported the way Proxmox's pct reports it: the message on stderr, exit 255 or errno."""

    def __init__(self, message, code=EXIT_ERROR):
        super().__init__(message)
        self.code = code


def parse_config(text):
    """(options, lxc entries) of the current config, as Config.pm's parse_pct_config reads it:
    `key: value` options, raw `lxc.key: value` or `lxc.key = value` entries in file order, `#`
    lines the description; the first `[section]` (a snapshot, pending changes) ends it."""
    options, lxc, description = {}, [], []
    for line in text.splitlines():
        if re.match(r"^\[[a-z][a-z0-9_:-]+\]\s*$", line, re.I):
            break
        if line.startswith("#"):
            description.append(line[1:])
            continue
        entry = re.match(r"^(lxc\.[a-z0-9_\-.]+)(:|\s*=)\s*(.*?)\s*$", line)
        if entry:
            lxc.append((entry.group(1), entry.group(3)))
            continue
        option = re.match(r"^([a-z][a-z_\-]*\d*):\s*(.*\S)\s*$", line)
        if option:
            options[option.group(1)] = option.group(2)
    if description:
        options["description"] = "\n".join(description)
    return options, lxc


def check_lock(options):
    """AbstractConfig.pm's check_lock: `die $class->guest_type() . " is locked ($conf->{lock})\n"`, the
    guest type of a container being `CT` (LXC/Config.pm guest_type)."""
    if options.get("lock"):
        raise PctError(f"CT is locked ({options['lock']})")


# AbstractConfig.pm's lock_config: a flock on the config's lock file, 10 s to get it.
CONFIG_LOCK_TIMEOUT_S = 10


@contextlib.contextmanager
def config_lock(node_root, vmid, timeout_s=CONFIG_LOCK_TIMEOUT_S):
    """Hold the config's file lock (pve-container's /run/lock/lxc/pve-config-<vmid>.lock: here the node's
    lock/ folder) while a command reads and writes the config, as lock_config does; a holder that keeps
    it past `timeout_s` fails the command in PVE::Tools::lock_file's words."""
    folder = os.path.join(node_root, "lock")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"pve-config-{vmid}.lock")
    with open(path, "a") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise PctError(f"can't lock file '/run/lock/lxc/pve-config-{vmid}.lock' - got timeout"
                                   ) from None
                time.sleep(0.1)
        yield


def read_config(node_root, vmid):
    """(options, lxc entries) of the container's config file; FileNotFoundError when there is none."""
    with open(os.path.join(node_root, "pve", "lxc", f"{vmid}.conf")) as f:
        return parse_config(f.read())


def write_config(node_root, vmid, options, lxc):
    """Replace the config file whole (write_pct_config's text), as pmxcfs does: never half-written."""
    path = os.path.join(node_root, "pve", "lxc", f"{vmid}.conf")
    with open(path + ".tmp", "w") as f:
        f.write(format_config(options, lxc))
    os.replace(path + ".tmp", path)


# The cluster's HA resources (pve-ha-manager's /etc/pve/ha/resources.cfg; /etc/pve is the sim's state dir
# here, as /etc/pve/nodes/<node> is its nodes/<node>/pve) and the CRM's command queue (crm_commands).
HA_RESOURCES = ("pve", "ha", "resources.cfg")
HA_CRM_COMMANDS = ("pve", "ha", "crm_commands")


def ha_resources(state_dir):
    """{sid: {key: value}} of resources.cfg, a section config: `ct: 200` then indented `key value` lines
    (HA/Resources.pm parse_section_header)."""
    path = os.path.join(state_dir, *HA_RESOURCES)
    resources, current = {}, None
    for line in open(path).read().splitlines() if os.path.exists(path) else []:
        header = re.match(r"^(\S+):\s*(\S+)\s*$", line)
        if header:
            current = resources.setdefault(f"{header.group(1).lower()}:{header.group(2)}", {})
        elif current is not None and line.strip() and line[:1].isspace():
            key, _, value = line.strip().partition(" ")
            current[key] = value.strip()
        elif not line.strip():
            current = None
    return resources


def ha_managed(state_dir, vmid):
    """HA/Config.pm vm_is_ha_managed: `vm:<vmid>` or `ct:<vmid>` is a resource whose state is not
    `ignored` (an ignored resource behaves as if HA did not manage it)."""
    resources = ha_resources(state_dir)
    return any(sid in resources and resources[sid].get("state") != "ignored"
               for sid in (f"vm:{vmid}", f"ct:{vmid}"))


def ha_configured(state_dir, vmid):
    """HA/Config.pm service_is_configured("ct:<vmid>"): any resources.cfg entry, ignored or not."""
    return f"ct:{vmid}" in ha_resources(state_dir)


def ha_request(state_dir, sid, state=None, crm_command=None):
    """What pct's HA path runs: `ha-manager set <sid> --state <state>` (the resource's state, resources.cfg
    written back as SectionConfig writes it) or `ha-manager crm-command stop <sid> <timeout>` (a line
    queued in crm_commands, HA/Config.pm queue_crm_commands). pvesim runs no CRM or LRM: a request stays
    queued, nothing acts on it."""
    if state is not None:
        resources = ha_resources(state_dir)
        resources[sid]["state"] = state
        path = os.path.join(state_dir, *HA_RESOURCES)
        with open(path + ".tmp", "w") as f:
            for name, props in resources.items():
                f.write(f"{name.replace(':', ': ', 1)}\n" + "".join(f"\t{k} {v}\n" for k, v in props.items())
                        + "\n")
        os.replace(path + ".tmp", path)
    if crm_command is not None:
        with open(os.path.join(state_dir, *HA_CRM_COMMANDS), "a") as f:
            f.write(crm_command + "\n")


def format_config(options, lxc):
    """Config.pm's write_pct_config: the description as # lines, options sorted, then lxc entries."""
    text = "".join(f"#{line}\n" for line in options.get("description", "").splitlines())
    text += "".join(f"{k}: {options[k]}\n" for k in sorted(options) if k != "description")
    text += "".join(f"{k}: {v}\n" for k, v in lxc)
    return text


def device_path(value):
    """The path of a devN value (`/dev/x` or `path=/dev/x,mode=0660,...`), checked as Config.pm's
    verify_lxc_dev_string checks it."""
    fields = dict(part.partition("=")[::2] if "=" in part else ("path", part) for part in value.split(","))
    path = fields.get("path")
    if path is None:
        raise PctError("Path is not defined for passthrough device")
    if re.search(r"/\.\.?(?:/|$)", path) or not path.startswith("/dev/"):
        raise PctError(f"{path} is not a valid device path")
    return path


def passthrough(options, lxc):
    """(path, optional) of every /dev/nvidia* device the config passes through: devN entries (PVE 8.1+)
    and bind mounts (lxc.mount.entry, the older form next to lxc.cgroup2.devices.allow)."""
    found = []
    for key in sorted((k for k in options if re.fullmatch(r"dev[0-9]+", k)), key=lambda k: int(k[3:])):
        found.append((device_path(options[key]), False))
    for key, value in lxc:
        parts = value.split()
        if key == "lxc.mount.entry" and parts and parts[0].startswith("/dev/nvidia"):
            found.append((parts[0], len(parts) > 3 and "optional" in parts[3].split(",")))
    return [(path, optional) for path, optional in found if path.startswith("/dev/nvidia")]


def check_devices(node, options):
    """The node's device nodes, after checking that each devN path is one of them: LXC/Tools.pm
    get_device_mode_and_rdev (`die "Device $path does not exist\n" if $! == ENOENT`), which pct create,
    pct set (Config.pm update_pct_config, pve-container 5.0.10 on) and every start run. The node's device
    nodes are those made since its boot (pct's node_devices)."""
    devices = node.node_devices()
    for key in sorted(k for k in options if re.fullmatch(r"dev[0-9]+", k)):
        path = device_path(options[key])
        if path not in devices:
            raise PctError(f"Device {path} does not exist", EXIT_ENOENT)
    return devices


def gpu_view(node, vmid, options, lxc):
    """What the container will see of the node's GPUs, or the failure of its start: a devN naming a
    device the node lacks fails in update_lxc_config (LXC/Tools.pm get_device_mode_and_rdev), a bind
    mount of one without `optional` fails in lxc-start's mount_entry."""
    devices = check_devices(node, options)
    present = []
    for path, optional in passthrough(options, lxc):
        if path in devices:
            present.append(path)
        elif not optional:
            raise PctError(f"mount_entry: 2416 No such file or directory - Failed to mount \"{path}\" onto "
                           f"\"/usr/lib/x86_64-linux-gnu/lxc/rootfs{path}\"\n"
                           f"command 'systemctl start pve-container@{vmid}' failed: exit code 1")
    gpus = sorted({int(m.group(1)) for m in map(GPU_DEVICE.match, present) if m})
    return {"gpus": gpus, "ctl": CONTROL_DEVICE in present}


def illegal_sequences(path):
    """Config.pm's verify_lxc_mp_string: no `/./` or `/../`, no `/.` or `/..` at the end, no `../` first."""
    return re.search(r"/\.\.?/", path) or re.search(r"/\.\.?$", path) or path.startswith("../")


def mount_point(value):
    """The properties of an mpN value as Config.pm parses it with $mp_desc (`volume` the default key,
    `mp` required, `ro` a boolean); pvesim models bind mount points only (the volume an absolute
    directory of the node, classify_mountpoint's `bind`), not storage volumes or devices."""
    props = {}
    for index, part in enumerate(filter(None, value.split(","))):
        key, eq, val = part.partition("=")
        if not eq and index == 0:
            key, val = "volume", part
        elif not eq:
            raise PctError(f"invalid format - value without key, but schema does not define a default "
                           f"key: {part}")
        props[key] = val
    for key in ("volume", "mp"):
        if key not in props:
            raise PctError(f"missing property - '{key}' is required")
        if illegal_sequences(props[key]):
            raise PctError(f"{props[key]} contains illegal character sequences")
    if "ro" in props:
        props["ro"] = "1" if props["ro"].lower() in TRUE_WORDS else "0"
    if not props["volume"].startswith("/") or props["volume"].startswith("/dev/"):
        raise PctError(f"pvesim models bind mount points only (an absolute directory of the node), not "
                       f"{props['volume']}")
    return props


def print_mount_point(props):
    """print_property_string: the default key's value first, then the other keys sorted."""
    return ",".join([props["volume"], *(f"{k}={props[k]}" for k in sorted(props) if k != "volume")])


def bind_mounts(options):
    """(node directory, container path, read-only) of every mpN, in valid_volume_keys' order (mp0, mp1,
    ...), as LXC.pm's mountpoint_mount bind mounts them at the container's start."""
    found = []
    for key in sorted((k for k in options if MOUNT_POINT.fullmatch(k)), key=lambda k: int(k[2:])):
        props = mount_point(options[key])
        found.append((props["volume"], props["mp"], props.get("ro") == "1"))
    return found


def check_bind_mounts(vmid, mounts):
    """A start fails when a bind mount's node directory is missing (LXC.pm mountpoint_mount: `die
    "directory '$volid' does not exist"` in the pre-start hook, before the container runs)."""
    for volume, _, _ in mounts:
        if not os.path.isdir(volume):
            raise PctError(f"directory '{volume}' does not exist\n"
                           f"run_buffer: 571 Script exited with status 255\n"
                           f"lxc_init: 845 Failed to run lxc.hook.pre-start for container \"{vmid}\"\n"
                           f"__lxc_start: 2034 Failed to initialize container \"{vmid}\"\n"
                           f"startup for container '{vmid}' failed")


def lxc_mount_entries(mounts):
    """The lxc.mount.entry lines of the bind mounts (fstab's escapes: a space is \\040)."""
    def escape(path):
        return path.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011")
    return "".join(f"lxc.mount.entry = {escape(volume)} {escape(mp.lstrip('/'))} none "
                   f"bind,create=dir{',ro' if ro else ''} 0 0\n" for volume, mp, ro in mounts)


class ConfigOptions:
    """The options `pct create` and `pct set` take (those a provisioning role uses)."""

    PLAIN = ("hostname", "cores", "memory", "swap", "rootfs", "unprivileged", "onboot", "ostype", "arch",
             "features", "description", "start", "storage", "delete", "startup")

    def __contains__(self, name):
        return name in self.PLAIN or bool(re.fullmatch(r"(dev|net|mp)[0-9]+", name))


# The volume a storage of each type allocates for a container's first disk (pve-storage's alloc_image:
# DirPlugin `<vmid>/vm-<vmid>-disk-0.raw`, LvmThinPlugin `vm-<vmid>-disk-0`, ZFSPoolPlugin's subvol).
DISK_VOLUMES = {"dir": "{vmid}/vm-{vmid}-disk-0.raw", "lvmthin": "vm-{vmid}-disk-0",
                "zfspool": "subvol-{vmid}-disk-0"}


def root_disk(node, vmid, storage, size):
    """The rootfs value of a new `<storage>:<GiB>` disk, refused as API2/LXC.pm's create_vm refuses it:
    a storage that does not exist (storage_check_enabled), one without `rootdir` content
    ($check_and_activate_storage)."""
    with open(os.path.join(node.root, "storage.json")) as f:
        store = json.load(f).get(storage)
    if store is None:
        raise PctError(f"storage '{storage}' does not exist")
    if "rootdir" not in store.get("content", []):
        raise PctError(f"400 Parameter verification failed.\nstorage: storage '{storage}' does not support "
                       "container directories\npct create <vmid> <ostemplate> [OPTIONS]")
    return f"{storage}:{DISK_VOLUMES[store['type']].format(vmid=vmid)},size={size}G"


def check_option(node, vmid, key, value):
    """The value written to the config for one option, checked as the API's JSON schema checks it."""
    def fail(why):
        raise PctError(f"400 Parameter verification failed.\n{key}: {why}")
    if key in ("cores", "memory", "swap"):
        low = {"cores": 1, "memory": 16, "swap": 0}[key]
        if not re.fullmatch(r"-?[0-9]+", value):
            fail(f"type check ('integer') failed - got '{value}'")
        if int(value) < low:
            fail(f"value must have a minimum value of {low}")
    elif key in ("unprivileged", "onboot", "start"):
        if value.lower() not in ("0", "1", "yes", "no", "true", "false", "on", "off"):
            fail(f"type check ('boolean') failed - got '{value}'")
        value = "1" if value.lower() in TRUE_WORDS else "0"
    elif key == "hostname":
        if not re.fullmatch(r"(?=.{1,255}$)[a-zA-Z0-9]([a-zA-Z0-9-]*[a-zA-Z0-9])?(\.[a-zA-Z0-9]([a-zA-Z0-9-]*"
                            r"[a-zA-Z0-9])?)*", value):
            fail("value does not look like a valid DNS name")
    elif key == "rootfs":
        match = re.fullmatch(r"([a-z][a-z0-9\-_.]*):([0-9]+(\.[0-9]+)?)", value)
        if not match:
            fail(f"invalid format - value '{value}' (want STORAGE:SIZE_IN_GiB)")
        value = root_disk(node, vmid, match.group(1), match.group(2))
    elif key == "startup":  # pve-common's pve-startup-order format
        if not re.fullmatch(r"((order=\d+|up=\d+|down=\d+)(,|$))+", value):
            fail(f"invalid format - value '{value}'")
    elif key.startswith("dev"):
        device_path(value)
    elif MOUNT_POINT.fullmatch(key):
        try:
            value = print_mount_point(mount_point(value))
        except PctError as exc:
            fail(str(exc))
    elif key.startswith("net") and not re.search(r"(^|,)name=", value):
        fail("missing property - 'name' is required")
    return value


def apply_options(node, vmid, options, opts):
    for key, value in opts.items():
        if key in ("start", "storage", "delete"):
            continue
        options[key] = check_option(node, vmid, key, value)
    for key in filter(None, opts.get("delete", "").split(",")):
        options.pop(key.strip(), None)
    return options
