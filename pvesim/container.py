"""A simulated Proxmox container: a real LXC container over the machine's own root.

The root is `overlay:/:<delta>`: the machine's python and the project's venv are visible inside, and
every write lands in the container's own delta dir. The container has its own PID namespace,
hostname and cgroup (`/pvesim-<tag>/lxc/<vmid>/ns` as the node sees it in /proc/<pid>/cgroup, so the
`/lxc/<vmid>/` part matches real Proxmox), and runs pvesim-init, which reaps orphans.

Files that exist only in the container's layer: the simulated nvidia-smi and its config, the init,
/etc/hostname, its own /root, and a whiteout hiding the node's /usr/sbin/pct. The node's GPU state
(nodes/<node>/gpu/) is bound in read-only: nvidia-smi reads the node's physical GPUs from it, and
which of them this container's config passed through when `pct start` started it.
"""

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import uuid
from pathlib import Path

from . import driver
from .host import PACKAGE_BIN, SimError

# The GPU generations a node may have (`pvesim up --gpu-generation`): nvidia-smi's name and memory, the
# PCI device ids of the GPU and of the board's NVSwitch (pci.ids: 2335 GH100 [H200 SXM 141GB], 22a3 GH100
# [H100 NVSwitch], 20b2 GA100 [A100 SXM4 80GB], 1af1 GA100 [A100 NVSwitch]) and how many NVSwitches an
# 8-GPU HGX board has (4 on HGX H100/H200, 6 on HGX A100). Hopper's `nvidia-smi -q` has a Fabric section,
# Ampere's none (NVML's GPU fabric info is Hopper's and later's).
GPU_GENERATIONS = {
    "hopper": {"name": "NVIDIA H200", "memory_mib": 143771, "pci_device": "2335", "nvswitch_device": "22a3",
               "nvswitches": 4, "fabric_info": True},
    "ampere": {"name": "NVIDIA A100-SXM4-80GB", "memory_mib": 81920, "pci_device": "20b2",
               "nvswitch_device": "1af1", "nvswitches": 6, "fabric_info": False},
}
GPU_NAME = GPU_GENERATIONS["hopper"]["name"]
GPU_MEMORY_MIB = GPU_GENERATIONS["hopper"]["memory_mib"]
# The node's NVIDIA driver (what nvidia-smi reports as driver_version, and the version of the installer
# `pvesim up` leaves on the node's storage).
DRIVER_VERSION = "550.127.05"
INIT_PATH = "/usr/sbin/pvesim-init"
NVIDIA_SMI_PATH = "/usr/bin/nvidia-smi"
NVIDIA_SMI_CONFIG = "/etc/pvesim/nvidia-smi.json"
# The container's bind mount points (its config's mpN): written by each `pct start`, included by its
# LXC config.
MOUNTS_FILE = "mounts.conf"
HOST_PROC_VIEW = "/run/pvesim/hostproc"  # read-only view of the node's /proc, for host PIDs
NODE_GPU_VIEW = "/run/pvesim/nodegpu"  # read-only view of the node's GPU state directory
# The devices of a node with GPUs besides /dev/nvidia<N>: the driver's control device and CUDA's.
CONTROL_DEVICES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def cgroup_base(tag, vmid):
    return f"/pvesim-{tag}/lxc/{vmid}"


def node_gpus(tag, node_name, count, generation="hopper"):
    """The node's simulated GPUs (of a GPU_GENERATIONS generation); UUIDs are stable for a given sim and
    node."""
    gpus, model = [], GPU_GENERATIONS[generation]
    for index in range(count):
        digest = hashlib.md5(f"{tag}/{node_name}/{index}".encode()).digest()
        gpus.append({"index": index, "uuid": f"GPU-{uuid.UUID(bytes=digest)}", "name": model["name"],
                     "memory_total": model["memory_mib"], "driver_version": DRIVER_VERSION})
    return gpus


def node_gpu_state(state_dir, node_name, gpus, compute_apps, nvswitch=False, generation="hopper"):
    """The node's GPU state as `pvesim up` writes it (no container running yet); pct start and stop
    record each container's passed-through GPUs and PID namespace in `containers`. `nvswitch`: an HGX
    board, whose GPUs need the fabric manager (pvesim/bin/nv-fabricmanager); `generation`: the GPUs' (a
    key of GPU_GENERATIONS: what nvidia-smi -q and lspci show). The device nodes are not
    here: they are the node's /dev layer of its boot (pvesim.node.new_boot)."""
    return json.dumps({"state_dir": str(state_dir), "node": node_name, "compute_apps": compute_apps,
                       "host_pidns": os.readlink("/proc/self/ns/pid"), "gpus": gpus, "nvswitch": nvswitch,
                       "generation": generation, "containers": {}})


def container_gpu_config(vmid):
    """nvidia-smi in a container: the GPUs passed through to it, read from the node's state; processes
    from the host's /proc (its PIDs are mapped to the container's own)."""
    return json.dumps({"state": f"{NODE_GPU_VIEW}/state.json", "proc": HOST_PROC_VIEW, "vmid": vmid})


def container_address(tag, vmid):
    """A container's own loopback address on a sim with the `loopback` network: 127.<sim>.<vmid>, the
    second octet from the sim's tag (sims side by side do not share addresses), never 127.0.x.x (the
    nodes' sshd addresses)."""
    return f"127.{1 + int(tag, 16) % 254}.{vmid >> 8 & 255}.{vmid & 255}"


def proxmox_config(vmid, gpu_indices, hostname=None, address=None):
    """The container's Proxmox config (what /etc/pve/nodes/<node>/lxc/<vmid>.conf holds), passing the
    node's GPUs `gpu_indices` through as PVE 8.1+ does (devN entries); with `address`, its net0 on
    vmbr0 with that static address."""
    lines = ["arch: amd64", "cores: 2"]
    devices = [f"/dev/nvidia{i}" for i in gpu_indices]
    if devices:
        devices += list(CONTROL_DEVICES)
    lines += [f"dev{i}: {path}" for i, path in enumerate(devices)]
    lines += ["features: nesting=1"]
    lines += [f"hostname: {hostname or f'ct{vmid}'}"]
    lines += [
        "memory: 8192",
    ]
    if address:
        lines += [f"net0: name=eth0,bridge=vmbr0,ip={address}/8,type=veth"]
    lines += [
        "ostype: debian",
        f"rootfs: local-lvm:vm-{vmid}-disk-0,size=32G",
        "swap: 0",
    ]
    return "".join(f"{line}\n" for line in lines)


# LXC's network types for pvesim's two networks: `isolated`, a network namespace of the container's own
# with loopback only; `loopback`, the machine's network namespace shared (each container reaches the
# others, and nothing else this machine does not reach, through its own 127.x.y.z address).
LXC_NETWORK = {"isolated": "empty", "loopback": "none"}


def lxc_config(tag, vmid, delta, gpu_dir, hostname, network="isolated"):
    return f"""\
# LXC container {vmid} of pvesim (written by pvesim)
lxc.uts.name = {hostname}
lxc.rootfs.path = overlay:/:{delta}
lxc.net.0.type = {LXC_NETWORK[network]}
lxc.mount.auto = proc:mixed sys:ro cgroup:mixed
lxc.autodev = 1
lxc.pty.max = 64
lxc.tty.max = 0
lxc.apparmor.profile = unconfined
lxc.init.cmd = {INIT_PATH}
lxc.signal.halt = SIGPWR
lxc.cgroup.dir.container = {cgroup_base(tag, vmid).lstrip("/")}
lxc.cgroup.dir.monitor = pvesim-{tag}/lxc.monitor/{vmid}
lxc.cgroup.dir.container.inner = ns
lxc.mount.entry = tmpfs tmp tmpfs rw,nosuid,nodev,mode=1777 0 0
lxc.mount.entry = tmpfs run tmpfs rw,nosuid,nodev,mode=755 0 0
lxc.mount.entry = tmpfs dev/shm tmpfs rw,nosuid,nodev,mode=1777,create=dir 0 0
lxc.mount.entry = /proc {HOST_PROC_VIEW.lstrip('/')} none bind,ro,create=dir 0 0
lxc.mount.entry = {gpu_dir} {NODE_GPU_VIEW.lstrip('/')} none bind,ro,create=dir 0 0
""" + "".join(f"lxc.mount.entry = {p} {p.lstrip('/')} none bind,ro,create=dir 0 0\n"
            for p in _hidden_controller_paths()) + f"lxc.include = {delta.parent / MOUNTS_FILE}\n"


# Paths where the container has its own filesystem (its own /root, tmpfs on /tmp and /run), so the
# node's files there are hidden inside.
CONTAINER_PRIVATE = ("/root", "/tmp", "/run", "/dev/shm")
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def _hidden_controller_paths():
    """What the containers must see of the machine but would not: the python the venv is built on
    (pyenv lives under /root), the venv and the project itself when they sit under a private path
    (a checkout in /tmp, say). They are bound in read-only at the same paths."""
    wanted = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, PROJECT_ROOT)}
    hidden = sorted(p for p in wanted if any(p == d or p.startswith(d + "/") for d in CONTAINER_PRIVATE))
    # A path inside another bound path comes with it.
    return [p for p in hidden if not any(p != q and p.startswith(q + "/") for q in hidden)]


# Debian's root dotfiles (base-files ships them); the fallbacks say the same in fewer words.
ROOT_DOTFILES = {
    ".profile": 'if [ "$BASH" ]; then\n  if [ -f ~/.bashrc ]; then\n    . ~/.bashrc\n  fi\nfi\n',
    ".bashrc": "# ~/.bashrc: executed by bash(1) for non-login shells.\n",
}


def _debian_default(name, fallback):
    try:
        with open(f"/usr/share/base-files/dot{name}", "rb") as f:
            return f.read()
    except OSError:
        return fallback.encode()


def _put(delta, path, data, mode):
    target = os.path.join(delta, path.lstrip("/"))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "wb") as f:
        f.write(data)
    os.chmod(target, mode)


def _whiteout(delta, path):
    """An overlayfs whiteout: the path of the lower layer (the node) does not exist in the container."""
    target = os.path.join(delta, path.lstrip("/"))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if not os.path.exists(target):
        os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0))


def nvidia_installer(version=DRIVER_VERSION):
    """The stand-in for NVIDIA's `NVIDIA-Linux-x86_64-<version>.run` on the node's storage: run in a
    container with --no-kernel-module it installs the user-space tools of that version (here the simulated
    nvidia-smi, whose version NVML compares with the node's kernel module); without that flag it fails as
    the real one does in a container, which cannot build or load a kernel module. Run on a node (its tools
    first on the PATH), it installs the driver there: pvesim/bin/nvidia-driver-tools' nvidia-installer."""
    tool = driver.user_space_tool(version)
    return f"""#!/bin/sh
# NVIDIA Accelerated Graphics Driver for Linux-x86_64 {version} (pvesim: user-space tools only)
case " $* " in
  *" --no-kernel-module "*) ;;
  *) if command -v nvidia-installer >/dev/null 2>&1 && command -v pvesim-cuda-init >/dev/null 2>&1; then
       exec nvidia-installer --version-of-run {version} "$@"
     fi
     echo "ERROR: Unable to load the kernel module 'nvidia.ko'. (pvesim: run with --no-kernel-module in a \
container)" >&2; exit 1 ;;
esac
cat > /usr/bin/nvidia-smi <<'PVESIM_NVIDIA_SMI'
{tool}PVESIM_NVIDIA_SMI
chmod 0755 /usr/bin/nvidia-smi
echo "Installation of the NVIDIA Accelerated Graphics Driver for Linux-x86_64 (version: {version}) is \
now complete."
"""


def etc_hosts(hostname, address=None):
    """The container's /etc/hosts as pve-container's setup writes it (PVE/LXC/Setup/Base.pm,
    `update_etc_hosts`): the hostname on its net0 address, or on 127.0.1.1 without one."""
    return (f"127.0.0.1 localhost.localdomain localhost\n::1 localhost ip6-localhost ip6-loopback\n"
            f"# --- BEGIN PVE ---\n{address or '127.0.1.1'} {hostname}\n# --- END PVE ---\n")


def write_lxc(node_files, tag, vmid, hostname, network="isolated", driver_tools=True):
    """Write the container's LXC config and the files of its own layer (what `pct create` makes).
    `driver_tools`: the NVIDIA user-space tools are installed (a hand-built container of `pvesim up`);
    a container `pct create` makes from a template has none until something installs them."""
    ct_dir = node_files.lxcpath / str(vmid)
    delta = ct_dir / "delta"
    delta.mkdir(parents=True, exist_ok=True)
    (ct_dir / "config").write_text(lxc_config(tag, vmid, delta, node_files.gpu_dir, hostname, network))
    (ct_dir / MOUNTS_FILE).touch()
    _put(delta, INIT_PATH, (PACKAGE_BIN / "pvesim-init").read_bytes(), 0o755)
    if driver_tools:
        _put(delta, NVIDIA_SMI_PATH, (PACKAGE_BIN / "nvidia-smi").read_bytes(), 0o755)
    _put(delta, NVIDIA_SMI_CONFIG, container_gpu_config(vmid).encode(), 0o644)
    _put(delta, "/etc/hostname", f"{hostname}\n".encode(), 0o644)
    address = container_address(tag, vmid) if network == "loopback" else None
    _put(delta, "/etc/hosts", etc_hosts(hostname, address).encode(), 0o644)
    _whiteout(delta, "/usr/sbin/pct")
    # The container's /root is its own (an opaque dir hides the node's /root, so a file copied to the
    # node's /root is NOT visible in the container), with root's dotfiles as a fresh Debian container has.
    root_home = delta / "root"
    root_home.mkdir(mode=0o700, exist_ok=True)
    os.setxattr(root_home, "trusted.overlay.opaque", b"y")
    for name, default in ROOT_DOTFILES.items():
        _put(delta, f"/root/{name}", _debian_default(name, default), 0o644)


def write_container(node_files, tag, vmid, gpu_indices, network="isolated"):
    """A container as `pvesim up` makes it: its LXC side and its Proxmox config."""
    write_lxc(node_files, tag, vmid, f"ct{vmid}", network)
    address = container_address(tag, vmid) if network == "loopback" else None
    (node_files.pve_confdir / f"{vmid}.conf").write_text(proxmox_config(vmid, gpu_indices, address=address))


def lxc(tool, node_files, vmid, *args, **kw):
    return subprocess.run([f"lxc-{tool}", "-n", str(vmid), "-P", str(node_files.lxcpath), *args],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, **kw)


def state(node_files, vmid):
    """RUNNING, STOPPED, ... as lxc-info reports it; None if LXC does not know the container."""
    res = lxc("info", node_files, vmid, "-s", "-H")
    return res.stdout.strip() if res.returncode == 0 else None


def init_pid(node_files, vmid):
    res = lxc("info", node_files, vmid, "-p", "-H")
    return int(res.stdout) if res.returncode == 0 and res.stdout.strip().isdigit() else None


def destroy(node_files, vmid):
    """Stop the container (hard) and remove everything of it, its layer included."""
    if state(node_files, vmid) not in (None, "STOPPED"):
        res = lxc("stop", node_files, vmid, "--kill")
        if state(node_files, vmid) not in (None, "STOPPED"):
            # Keep its files: without its config nothing could stop it any more.
            raise SimError(f"container {vmid} of {node_files.name} did not stop: {res.stderr.strip()}")
    ct_dir = node_files.lxcpath / str(vmid)
    if ct_dir.is_dir():
        shutil.rmtree(ct_dir)
    (node_files.pve_confdir / f"{vmid}.conf").unlink(missing_ok=True)
