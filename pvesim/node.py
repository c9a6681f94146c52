"""A simulated Proxmox node: one real sshd on a loopback address, with its own host key and settings.

`SetEnv` in the node's sshd_config tells every session which node and state dir it belongs to (for
/usr/sbin/pct) and puts the node's own tools (the node-side nvidia-smi) first on PATH.
"""

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from . import procs
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
              files.template_cache, files.snippets):
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
# The state dir may live under a world-writable /tmp.
StrictModes no
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
                         ("pveversion", "pve-node-tools"), ("pveam", "pve-node-tools"),
                         ("lsmod", "pve-node-tools")):
        shutil.copyfile(PACKAGE_BIN / source, files.bin / tool)
        (files.bin / tool).chmod(0o755)
    files.storage_config.write_text(json.dumps(DEFAULT_STORAGES))
    files.template_index.write_text(json.dumps(TEMPLATE_INDEX))
    installer = files.snippets / f"NVIDIA-Linux-x86_64-{DRIVER_VERSION}.run"
    installer.write_text(nvidia_installer())
    installer.chmod(0o755)
    files.gpu_state.write_text(gpu_state_json)
    # A user other than root runs the node's nvidia-smi through sudo (the sim's driver reads root's /proc).
    files.gpu_config.write_text(json.dumps({"state": str(files.gpu_state), "proc": "/proc", "as_root": True}))
    (files.template_cache / TEMPLATE).touch()
    files.provision.write_text(json.dumps({"python": sys.executable, "path": str(PACKAGE_BIN.parents[1])}))
    return host_key


# Run in a private mount namespace, this hides each path given as an argument behind an overlay
# whiteout (the path is gone, its directory's other entries stay), then execs the rest of the argv.
HIDE_SCRIPT = """\
set -e
top=$1; shift
while [ "$1" != -- ]; do
  dir=$(dirname "$1"); name=$(basename "$1"); layer=$top/$(echo "$dir" | tr / _)
  mkdir -p "$layer/upper" "$layer/work"
  [ -e "$layer/upper/$name" ] || mknod "$layer/upper/$name" c 0 0
  mount -t overlay overlay -o "lowerdir=$dir,upperdir=$layer/upper,workdir=$layer/work" "$dir"
  shift
done
shift
exec "$@"
"""


def start_sshd(files, address, port):
    """Start the node's sshd (it daemonizes itself); return (pid, start time). While the node has
    hidden paths (`files.hidden`), sshd runs in its own mount namespace where they do not exist."""
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    files.pidfile.unlink(missing_ok=True)
    argv = [SSHD, "-f", str(files.sshd_config), "-E", str(files.log)]
    hidden = files.hidden_paths()
    if hidden:
        argv = ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", HIDE_SCRIPT, "sh",
                str(files.root / "hidden"), *hidden, "--", *argv]
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
