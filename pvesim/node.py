"""A simulated Proxmox node: one real sshd on a loopback address, with its own host key and settings.

`SetEnv` in the node's sshd_config tells every session which node and state dir it belongs to (for
/usr/sbin/pct) and puts the node's own tools (the node-side nvidia-smi) first on PATH.
"""

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

from . import driver, procs
from .container import DRIVER_VERSION, nvidia_installer
from .host import PACKAGE_BIN, SimError, node_tools_dir

SSHD = "/usr/sbin/sshd"
NODE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
START_TIMEOUT_S = 10.0


def node_address(index):
    """pve1 listens on 127.0.0.2, pve2 on 127.0.0.3, ...: each node its own loopback address."""
    return f"127.0.0.{2 + index}"


def free_port(address):
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def keygen(path, comment):
    if not path.exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                       check=True, stdin=subprocess.DEVNULL)
    return path.with_name(path.name + ".pub").read_text().split()[:2]


class NodeFiles:
    """Paths of one node under <state dir>/nodes/<name>/."""

    def __init__(self, state_dir, name):
        self.state_dir = Path(state_dir)
        self.name = name
        self.root = self.state_dir / "nodes" / name
        self.lxcpath = self.root / "lxc"
        self.pve_confdir = self.root / "pve" / "lxc"
        # The node's own tools (nvidia-smi) first on its sessions' PATH, where any node user can run them.
        self.bin = node_tools_dir(self.state_dir.resolve()) / name / "bin"
        self.host_key = self.root / "ssh_host_ed25519_key"
        self.host_key_pub = self.root / "ssh_host_ed25519_key.pub"
        # Paths that do not exist for the node's sessions, one a line (Sim.hide_on_node).
        self.hidden_list = self.root / "hidden.list"
        # The node's own /dev additions since its boot (the NVIDIA device nodes nvidia-modprobe, nvidia-smi
        # or a CUDA program made): one layer a boot, `dev/current` the running boot's, laid over the
        # machine's /dev for the node's sessions; pct reads its `upper` directly. The node's own systemd
        # units (/etc/systemd/system) are a layer of their own, kept across reboots.
        self.dev_root = self.root / "dev"
        self.dev_current = self.dev_root / "current"
        self.units_layer = self.root / "systemd"
        self.sshd_config = self.root / "sshd_config"
        self.pidfile = self.root / "sshd.pid"
        self.log = self.root / "sshd.log"
        # The node's nvidia-smi reads the config next to it; its GPU state is shared with the containers.
        self.gpu_config = self.bin / "nvidia-smi.json"
        self.gpu_dir = self.root / "gpu"
        self.gpu_state = self.gpu_dir / "state.json"
        # The storages' files, beside the node's tools, where any user may look (as in a real node's
        # /var/lib/vz, whereas a state dir may sit under a directory only root can enter); the node's
        # storage/ links there. Storage `local` (a dir storage): container templates under
        # template/cache/, other files (PVE's `snippets` content: the NVIDIA driver's installer) in snippets/.
        self.storage = self.bin.parent / "storage"
        self.template_cache = self.storage / "local" / "template" / "cache"
        self.snippets = self.storage / "local" / "snippets"
        # The node's appliance index (pveam available), {section: [template file]}.
        self.template_index = self.root / "aplinfo.json"
        # The node's storages, their types, content types and sizes (what pvesm status reports).
        self.storage_config = self.root / "storage.json"
        # The node's VMs (pvesim models only their configs: vmids are cluster-wide unique).
        self.qemu_confdir = self.root / "pve" / "qemu-server"
        # What `pct create` and `pct destroy` run for the LXC side: this Python and package.
        self.provision = self.root / "provision.json"

    def hidden_paths(self):
        try:
            return [line for line in self.hidden_list.read_text().splitlines() if line]
        except FileNotFoundError:
            return []

    def session_env(self):
        """What every ssh session on this node gets; pct reads PVESIM_STATE_DIR and PVESIM_NODE."""
        return {
            "PVESIM_STATE_DIR": str(self.state_dir),
            "PVESIM_NODE": self.name,
            "PATH": f"{self.bin}:{NODE_PATH}",
        }


# The template `pct create` finds on storage local (an empty stand-in: containers share the machine's root).
TEMPLATE = "debian-12-standard_12.7-1_amd64.tar.zst"
# The node's appliance index (what `pveam update` fetched from download.proxmox.com: its `system` and
# `turnkeylinux` sections, abridged), TEMPLATE the newest debian-12-standard in it;
# prerequisites.move_template_index moves it on to NEWER_TEMPLATE.
TEMPLATE_INDEX = {
    "system": ["alpine-3.20-default_20240908_amd64.tar.xz", "debian-11-standard_11.7-1_amd64.tar.zst",
               TEMPLATE, "ubuntu-24.04-standard_24.04-2_amd64.tar.zst"],
    "turnkeylinux": ["debian-12-turnkey-core_18.0-1_amd64.tar.gz"],
}
NEWER_TEMPLATE = "debian-12-standard_12.12-1_amd64.tar.zst"
# A default Proxmox VE 8 install's storages (pve-installer's storage.cfg on LVM): `local`, a dir storage
# on the root filesystem for ISO images, templates and backups, and `local-lvm`, the LVM-thin pool
# `data` for container and VM disks. The sizes are pvesim's (room: Sim.set_storage_size).
DEFAULT_STORAGES = {
    "local": {"type": "dir", "total_gib": 96, "content": ["backup", "iso", "vztmpl"]},
    "local-lvm": {"type": "lvmthin", "total_gib": 1024, "content": ["images", "rootdir"]},
}


def write_node(files, address, port, authorized_keys, gpu_state_json, node_user=None):
    """Create the node's directories, host key, sshd_config, node-side nvidia-smi and GPU state. A
    `node_user` logs in with the key of its own ~/.ssh/authorized_keys, as on a real node."""
    for d in (files.lxcpath, files.pve_confdir, files.qemu_confdir, files.bin, files.gpu_dir,
              files.template_cache, files.snippets, files.units_layer / "upper", files.units_layer / "work"):
        d.mkdir(parents=True, exist_ok=True)
    if not (files.root / "storage").is_symlink():
        (files.root / "storage").symlink_to(files.storage)
    for d in (files.bin, *files.bin.parents):
        if d == files.bin.parents[3]:  # /run/pvesim and above are not ours to change
            break
        d.chmod(0o755)
    user_keys = f"Match User {node_user}\n    AuthorizedKeysFile .ssh/authorized_keys\n" if node_user else ""
    host_key = keygen(files.host_key, f"root@{files.name}")
    setenv = " ".join(f"{k}={v}" for k, v in files.session_env().items())
    files.sshd_config.write_text(f"""\
# sshd of the simulated Proxmox node {files.name} (written by pvesim)
Port {port}
ListenAddress {address}
HostKey {files.host_key}
PidFile {files.pidfile}
AuthorizedKeysFile {authorized_keys}
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PermitRootLogin prohibit-password
# As a stock node's: key files and their directories root's (or the user's) and not group/world-writable
# (OpenSSH misc.c safe_path()); root's authorized_keys is in pvesim's root-only keys dir, not the state dir.
StrictModes yes
UseDNS no
PrintMotd no
PrintLastLog no
MaxStartups 100
MaxSessions 100
SetEnv {setenv}
Subsystem sftp internal-sftp
LogLevel INFO
{user_keys}""")
    for tool, source in (("nvidia-smi", "nvidia-smi"), ("pvesm", "pvesm"), ("pvesh", "pvesm"),
                         ("vzdump", "vzdump"), ("pct_config.py", "pct_config.py"),
                         ("pveversion", "pve-node-tools"), ("pveam", "pve-node-tools"),
                         ("lsmod", "pve-node-tools"), ("nvidia-modprobe", "nvidia-modprobe"),
                         ("systemctl", "systemctl"), ("pvesim-cuda-init", "nvidia-modprobe"),
                         ("lspci", "lspci")):
        shutil.copyfile(PACKAGE_BIN / source, files.bin / tool)
        (files.bin / tool).chmod(0o755)
    files.storage_config.write_text(json.dumps(DEFAULT_STORAGES))
    files.template_index.write_text(json.dumps(TEMPLATE_INDEX))
    driver.install_node_tools(files, DRIVER_VERSION)
    installer = files.snippets / f"NVIDIA-Linux-x86_64-{DRIVER_VERSION}.run"
    installer.write_text(nvidia_installer())
    installer.chmod(0o755)
    files.gpu_state.write_text(gpu_state_json)
    # A user other than root runs the node's nvidia-smi through sudo (the sim's driver reads root's /proc).
    files.gpu_config.write_text(json.dumps({"state": str(files.gpu_state), "proc": "/proc", "as_root": True}))
    (files.template_cache / TEMPLATE).touch()
    files.provision.write_text(json.dumps({"python": sys.executable, "path": str(PACKAGE_BIN.parents[1])}))
    return host_key


# A GPU node's boot as its device nodes see it: the kernel module is loaded (the driver installed), and
# no NVIDIA device node exists until nvidia-modprobe, nvidia-smi or a CUDA program makes them (NVIDIA's
# driver README, "How and when are the NVIDIA device files created?"; docs/PVESIM.md). `prepared`: as after
# `nvidia-modprobe -c0 -u` and nvidia-smi ran (what `pvesim up` gives: a node its admin set up).
DEVICE_NODES = {"/dev/nvidiactl": (195, 255), "/dev/nvidia-uvm": (511, 0), "/dev/nvidia-uvm-tools": (511, 1)}


def new_boot(files, gpu_count, prepared=False):
    """Start the node's next boot's /dev layer (empty: nothing made since boot) and make it current."""
    files.dev_root.mkdir(parents=True, exist_ok=True)
    boots = [int(p.name[5:]) for p in files.dev_root.glob("boot-*") if p.name[5:].isdigit()]
    boot = files.dev_root / f"boot-{max(boots, default=0) + 1}"
    for old in boots:  # no session of an earlier boot is left (the node's sshd stopped)
        shutil.rmtree(files.dev_root / f"boot-{old}", ignore_errors=True)
    (boot / "upper").mkdir(parents=True)
    (boot / "work").mkdir()
    # The machine's own NVIDIA device nodes (a GPU machine's) are not the node's: whiteouts hide them.
    for name in os.listdir("/dev"):
        if name.startswith("nvidia"):
            os.mknod(boot / "upper" / name, stat.S_IFCHR, os.makedev(0, 0))
    # The boot loader's default kernel; nvidia.ko loads if that kernel has one (pvesim.driver).
    loads = driver.boot(files)
    modules = ["nvidia"] if gpu_count and loads else []
    if prepared and modules:
        made = {**DEVICE_NODES, **{f"/dev/nvidia{i}": (195, i) for i in range(gpu_count)}}
        for path, (major, minor) in made.items():
            (boot / "upper" / path[5:]).unlink(missing_ok=True)
            os.mknod(boot / "upper" / path[5:], stat.S_IFCHR | 0o666, os.makedev(major, minor))
        modules.append("nvidia_uvm")
    (boot / "modules").write_text("".join(f"{m}\n" for m in modules))
    tmp = files.dev_root / "current.tmp"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(boot.name)
    tmp.replace(files.dev_current)


# Run in a private mount namespace: lays the node's /dev layer over /dev (the machine's submounts of /dev,
# pts and shm, moved back on top) and its units layer over /etc/systemd/system, hides each path given as an
# argument behind an overlay whiteout (the path is gone, its directory's other entries stay), then execs the
# rest of the argv.
NODE_NAMESPACE_SCRIPT = """\
set -e
top=$1 dev=$2 units=$3; shift 3
mkdir -p "$top/machine-dev"
mount --rbind /dev "$top/machine-dev"
mount -t overlay overlay -o "lowerdir=/dev,upperdir=$dev/upper,workdir=$dev/work" /dev
for sub in $(findmnt -rn -o TARGET -R "$top/machine-dev" | sed -n "s|^$top/machine-dev/||p" | grep -v / \
             | sort -u); do
  mount --move "$top/machine-dev/$sub" "/dev/$sub"
done
umount -l "$top/machine-dev"
mount -t overlay overlay -o "lowerdir=/etc/systemd/system,upperdir=$units/upper,workdir=$units/work" \
  /etc/systemd/system
while [ "$1" != -- ]; do
  dir=$(dirname "$1"); name=$(basename "$1"); layer=$top/hidden/$(echo "$dir" | tr / _)
  mkdir -p "$layer/upper" "$layer/work"
  [ -e "$layer/upper/$name" ] || mknod "$layer/upper/$name" c 0 0
  mount -t overlay overlay -o "lowerdir=$dir,upperdir=$layer/upper,workdir=$layer/work" "$dir"
  shift
done
shift
exec "$@"
"""


def start_sshd(files, address, port):
    """Start the node's sshd (it daemonizes itself); return (pid, start time). sshd runs in a mount
    namespace of its own where /dev has the node's device nodes of this boot, /etc/systemd/system its
    own units, and the node's hidden paths (`files.hidden`) do not exist."""
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    files.pidfile.unlink(missing_ok=True)
    argv = ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", NODE_NAMESPACE_SCRIPT, "sh",
            str(files.root), str(files.dev_current.resolve()), str(files.units_layer), *files.hidden_paths(),
            "--", SSHD, "-f", str(files.sshd_config), "-E", str(files.log)]
    res = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if res.returncode != 0:
        raise SimError(f"sshd of {files.name} did not start on {address}:{port}: "
                        f"{res.stderr.strip()} {tail(files.log)}")
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        pid = read_pid(files.pidfile)
        if pid and accepts(address, port):
            return pid, procs.start_time(pid)
        time.sleep(0.02)
    raise SimError(f"sshd of {files.name} is not listening on {address}:{port}: {tail(files.log)}")


def read_pid(path):
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None


def accepts(address, port):
    try:
        with socket.create_connection((address, port), timeout=0.5):
            return True
    except OSError:
        return False


def sshd_is_ours(pid, files):
    """True if `pid` is an sshd started with this node's config (guards against a reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()  # sshd rewrites it into one line
    except OSError:
        return False
    return str(files.sshd_config).encode() in cmdline


def stop_sshd(files, pid=None, started=None):
    """Stop the node's sshd and every session under it (by pid: recorded, else the pidfile)."""
    if pid and procs.is_alive(pid, started):
        procs.stop_tree(pid, started)  # the recorded process itself: pid and start time match
    pid = read_pid(files.pidfile)
    if pid and procs.is_alive(pid) and sshd_is_ours(pid, files):
        procs.stop_tree(pid, procs.start_time(pid))


def tail(path, lines=5):
    try:
        return " | ".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
