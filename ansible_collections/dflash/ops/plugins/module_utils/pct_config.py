# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A container's options as `pct config` prints them and `pct create` / `pct set` take them: the wanted
options from proxmox_container's parameters, the parse of `pct config`, and their comparison (pure
functions; proxmox_container runs pct)."""

from __future__ import annotations

import re

from ansible_collections.dflash.ops.plugins.module_utils.pct_cli import passed_devices


def device_values(gpus, control_devices, unprivileged, gid):
    """The devN values, GPUs first in node order: `/dev/nvidiaN`, owned in an unprivileged container by
    the group `gid` (pve-container's devN `gid=`; a privileged container keeps the node's owner)."""
    paths = [f"/dev/nvidia{minor}" for minor in sorted(gpus)] + (list(control_devices) if gpus else [])
    return [f"{path},gid={gid}" if unprivileged else path for path in paths]


def mount_values(mounts):
    """The mpN values of the bind mounts, as pve-container writes them (Config.pm print_ct_mountpoint,
    pve-common's print_property_string: the default key `volume`, the node's directory, first, then the
    required `mp`, then the rest sorted: `replicate`, `ro`). `replicate=0`: a node's directory is no
    storage volume a replication job can copy, and a job refuses a container with one it would include
    (pve-guest-common's replication; Config.pm `$mp_desc`: replicate defaults to 1)."""
    return [f"{m['node_path']},mp={m['container_path']},replicate=0" + (",ro=1" if m["read_only"] else "")
            for m in mounts]


def is_bind_mount(value):
    """An mpN value whose volume is a directory of the node (Config.pm classify_mountpoint's `bind`:
    an absolute path, not under /dev/), not a storage volume or a device."""
    volume = properties(value, "volume").get("volume", "")
    return volume.startswith("/") and not volume.startswith("/dev/")


def wanted_config(params):
    """key -> value as pct config prints it (the root disk as `storage:GiB`, what pct create takes)."""
    wanted = {
        "hostname": params["hostname"] or f"CT{params['vmid']}",
        "cores": str(params["cores"]),
        "memory": str(params["memory"]),
        "swap": str(params["swap"]),
        "rootfs": f"{params['rootfs_storage']}:{params['rootfs_size']}",
        "unprivileged": "1" if params["unprivileged"] else "0",
        "onboot": "1" if params["onboot"] else "0",
    }
    if params["unprivileged"] and params["nesting"]:
        wanted["features"] = "nesting=1"
    wanted.update({key: str(value) for key, value in sorted(params["networks"].items())})
    values = device_values(params["gpus"], params["control_devices"], params["unprivileged"],
                           params["device_gid"])
    wanted.update({f"dev{i}": value for i, value in enumerate(values)})
    wanted.update({f"mp{i}": value for i, value in enumerate(mount_values(params["mounts"]))})
    return wanted


def parse_config(text):
    """The options of `pct config` (key: value), lxc.* entries and the description left out."""
    options = {}
    for line in text.splitlines():
        key, sep, value = line.partition(": ")
        if sep and re.fullmatch(r"[a-z][a-z_\-]*[0-9]*", key):
            options[key] = value.strip()
    return options


def properties(value, default_key=None):
    """A property string (`/dev/nvidia0,gid=44` or `name=eth0,bridge=vmbr0`) as a dict."""
    props = {}
    for part in filter(None, value.split(",")):
        key, eq, val = part.partition("=")
        if eq:
            props[key] = val
        elif default_key:
            props[default_key] = part
    return props


def is_true(value):
    """A boolean property as pve-common's JSON schema reads it (absent: false)."""
    return (value or "0").lower() in ("1", "yes", "true", "on")


def same(key, have, want):
    if have is None:
        return False
    if key == "rootfs":  # `local:204/vm-204-disk-0.raw,size=32G` is `local:32`
        storage, size = want.split(":", 1)
        return have.split(":")[0] == storage and properties(have).get("size") == f"{size}G"
    if key == "features" or re.fullmatch(r"(dev|net)[0-9]+", key):  # the properties given, whatever else
        default = "path" if key.startswith("dev") else None
        have_props = properties(have, default)
        return all(have_props.get(k) == v for k, v in properties(want, default).items())
    if re.fullmatch(r"mp[0-9]+", key):  # the node's directory, the container's path and ro, nothing else
        have_props, want_props = properties(have, "volume"), properties(want, "volume")
        return (all(have_props.get(k) == want_props.get(k) for k in ("volume", "mp"))
                and all(is_true(have_props.get(k, default)) == is_true(want_props.get(k, default))
                        for k, default in (("ro", "0"), ("replicate", "1"))))
    if key in ("unprivileged", "onboot"):
        return (have or "0") == want
    return have == want


def config_differences(wanted, actual):
    """[{key, have, want}] for every key that differs; a devN passing an NVIDIA device through and an mpN
    bind mounting a node's directory that the options do not have are to be deleted (want None); a
    storage volume's mount point is not the inventory's to remove."""
    diffs = [{"key": key, "have": actual.get(key), "want": value} for key, value in wanted.items()
             if not same(key, actual.get(key), value)]
    for key in sorted(actual):
        if key in wanted:
            continue
        extra_device = re.fullmatch(r"dev[0-9]+", key) and passed_devices([f"{key}: {actual[key]}"])
        extra_mount = re.fullmatch(r"mp[0-9]+", key) and is_bind_mount(actual[key])
        if extra_device or extra_mount:
            diffs.append({"key": key, "have": actual[key], "want": None})
    return diffs


def config_text(options):
    return "".join(f"{key}: {options[key]}\n" for key in sorted(options))


def applied(actual, diffs):
    after = dict(actual)
    for d in diffs:
        if d["want"] is None:
            after.pop(d["key"], None)
        else:
            after[d["key"]] = d["want"]
    return after


def options_argv(options):
    args = []
    for key, value in options.items():
        args += [f"--{key}", value]
    return args
