"""pvesim's Python API: up, down, load and the Sim they return.

A sim lives in its state dir: sim.json (the layout and the pids it started), the client key pair,
a known_hosts file, and nodes/<name>/ (sshd config and host key, LXC containers, Proxmox configs).
Several sims run side by side with different state dirs.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from . import container, host, node, prerequisites, procs
from .host import SimError

REPO_ROOT = Path(__file__).resolve().parent.parent
# One default state dir per checkout (its name and a hash of its path): `make sim-down` in one clone never
# ends another clone's simulation.
DEFAULT_STATE_DIR = Path("/var/lib/pvesim") / (
    f"{REPO_ROOT.name}-{hashlib.sha1(str(REPO_ROOT).encode()).hexdigest()[:8]}")
DEFAULT_INVENTORY = REPO_ROOT / "inventory" / "sim" / "hosts.yml"
STATE_FILE = "sim.json"
INVENTORY_HEADER = "# Written by `python -m pvesim up --state-dir {state_dir}`; `pvesim down` removes it.\n"
MAX_GPUS = 16
# The compute-apps list of a node's driver (see pvesim/bin/nvidia-smi): "host" lists every process on a
# device with host PIDs, also in a container (older drivers); "container" lists in a container only its
# own processes, with its PIDs (newer drivers).
COMPUTE_APPS = ("host", "container")
# The python of a Debian/Proxmox node, also what containers see through their overlay root. Named in the
# inventory because interpreter discovery would follow whatever the login shell puts first on PATH.
NODE_PYTHON = "/usr/bin/python3"
# The project's connection (the dflash.ops collection's pct_pipelined): proxmox_pct_remote with pipelining.
CONNECTION = "dflash.ops.pct_pipelined"


@dataclass
class SimNode:
    name: str
    address: str
    port: int
    containers: list[int]
    sshd_pid: int | None = None
    sshd_started: int | None = None


@dataclass
class Sim:
    state_dir: Path
    nodes: list[SimNode]
    gpus: int
    inventory_path: Path
    tag: str = field(default="")
    # {vmid: node GPU indices passed through}, and {node name: compute-apps behaviour}.
    passthrough: dict = field(default_factory=dict)
    compute_apps: dict = field(default_factory=dict)
    # The user Ansible logs in to the nodes as (None: root), with the sudo rule for pct.
    node_user: str | None = None
    # The sudoers file whose rules the node user gets (None: production's, sudoers.d/ansible_pct).
    sudo_rule: str | None = None
    # "isolated" (each container its own network namespace, loopback only) or "loopback" (containers
    # share the machine's, each with its own 127.x.y.z address: containers on vmbr0 reaching each other).
    network: str = "isolated"
    # HGX boards: each node's GPUs behind NVSwitches, CUDA waiting for the fabric manager.
    nvswitch: bool = False
    # The GPUs' generation (container.GPU_GENERATIONS): "hopper" (H200; nvidia-smi -q has a Fabric
    # section) or "ampere" (A100; none).
    gpu_generation: str = "hopper"

    def address_of(self, vmid):
        """The container's own address on the `loopback` network (its net0 ip); None when isolated."""
        self.node_of(vmid)
        return container.container_address(self.tag, vmid) if self.network == "loopback" else None

    @property
    def private_key(self):
        return self.state_dir / "id_ed25519"

    @property
    def authorized_keys(self):
        """Root's authorized_keys of the sim's nodes: in a root-only directory outside the state dir, which
        may be under /tmp, where the nodes' sshd (StrictModes) would refuse it (host.KEYS)."""
        return host.keys_dir(self.state_dir) / "authorized_keys"

    @property
    def known_hosts(self):
        return self.state_dir / "known_hosts"

    @property
    def containers(self):
        return [vmid for n in self.nodes for vmid in n.containers]

    def node(self, name):
        for n in self.nodes:
            if n.name == name:
                return n
        raise SimError(f"no node {name!r} in the sim at {self.state_dir}")

    def node_of(self, vmid):
        """The node of a container of the sim's layout, or of one `pct create` made since."""
        for n in self.nodes:
            if vmid in n.containers or (_node_files(self, n.name).pve_confdir / f"{vmid}.conf").exists():
                return n
        raise SimError(f"no container {vmid} in the sim at {self.state_dir}")

    def ssh_argv(self, node_name, user="root"):
        """The ssh command line reaching a node as `user` (root, or the node user), host key checking on."""
        n = self.node(node_name)
        return ["ssh", "-i", str(self.private_key), "-p", str(n.port),
                "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", f"{user}@{n.address}"]

    def ssh(self, node_name, command, timeout=60, user="root", **kw):
        """Run a shell command on a node over real ssh; returns the CompletedProcess (text, captured)."""
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run([*self.ssh_argv(node_name, user), command], timeout=timeout,
                              stdin=kw.pop("stdin", subprocess.DEVNULL), **kw)

    def stop_node(self, name):
        """Make a node unreachable: stop its sshd (and every session under it). Its containers and
        what runs in them go on, as on a node whose network is down."""
        n = self.node(name)
        node.stop_sshd(_node_files(self, name), n.sshd_pid, n.sshd_started)
        n.sshd_pid = n.sshd_started = None
        self.save()

    def start_node(self, name):
        """Make a stopped node reachable again: its sshd on the same address, port and host key."""
        n = self.node(name)
        if procs.is_alive(n.sshd_pid, n.sshd_started):
            return
        n.sshd_pid, n.sshd_started = node.start_sshd(_node_files(self, name), n.address, n.port)
        self.save()

    def reboot_node(self, name, timeout=900):
        """A node's reboot as pve-guests.service does it: `pvesh create /nodes/localhost/stopall` (every
        running container shut down, then stopped), the node's sshd down and, in its next boot, up (its
        sessions end; no NVIDIA device node exists until something makes one: node.new_boot), the node's
        own units ordered Before=pve-guests.service, then `.../startall` (the containers with `onboot: 1`,
        by startup order), then its other units. Returns what they said."""
        said = []
        for step in ("stopall", "before", "startall", "after"):
            if step == "before":
                self.stop_node(name)
                node.new_boot(_node_files(self, name), self.gpus)
                # Fabric Manager sets the NVSwitch fabric up again at each boot (nv-fabricmanager writes it).
                (_node_files(self, name).gpu_dir / "fabric").unlink(missing_ok=True)
                self.start_node(name)
            pvesh = step in ("stopall", "startall")
            command = f"pvesh --nooutput create /nodes/localhost/{step}" if pvesh else \
                f"systemctl --pvesim-boot {step}"
            res = self.ssh(name, command, timeout=timeout)
            said.append(res.stdout + res.stderr)
            if res.returncode != 0 and pvesh:  # a unit that fails is the node's, as on a real boot
                raise SimError(f"{step} on {name} failed (exit {res.returncode}): {res.stderr.strip()}")
        return "".join(said)

    def rotate_host_key(self, name):
        """Give a node a new host key (a reinstalled node, or a machine in the middle): its sshd
        restarts with it, and the known_hosts files keep the old key until `trust_host_keys()`."""
        files = _node_files(self, name)
        files.host_key.unlink(missing_ok=True)
        files.host_key_pub.unlink(missing_ok=True)
        node.keygen(files.host_key, f"root@{name}")
        self.stop_node(name)
        self.start_node(name)

    def hide_on_node(self, name, paths=()):
        """Make `paths` (absolute files) not exist for the node's sessions, e.g. ["/usr/sbin/pct"] for a
        machine that is not a Proxmox VE node; `paths=()` shows them again. The node's sshd restarts in
        a mount namespace of its own (the nodes share this machine's filesystem), so sessions open
        on the node end."""
        files = _node_files(self, name)
        for path in paths:
            if not str(path).startswith("/") or not Path(path).parent.is_dir():
                raise SimError(f"cannot hide {path!r}: not an absolute path in an existing directory")
        files.hidden_list.write_text("".join(f"{p}\n" for p in paths))
        self.stop_node(name)
        self.start_node(name)

    def add_vm(self, node_name, vmid, name=None):
        """A VM on a node: its config only (pvesim runs no VMs), enough to take its vmid cluster-wide."""
        files = _node_files(self, node_name)
        files.qemu_confdir.mkdir(parents=True, exist_ok=True)
        (files.qemu_confdir / f"{vmid}.conf").write_text(f"memory: 2048\nname: {name or f'vm{vmid}'}\n")

    def set_storage_size(self, node_name, total_gib, storage="local-lvm"):
        """Resize a storage of a node (what pvesm status reports as its total)."""
        files = _node_files(self, node_name)
        config = json.loads(files.storage_config.read_text())
        config[storage]["total_gib"] = total_gib
        files.storage_config.write_text(json.dumps(config))

    def host_key_lines(self):
        """The known_hosts line of each node's current host key."""
        lines = []
        for n in self.nodes:
            key = _node_files(self, n.name).host_key_pub.read_text().split()[:2]
            lines.append(f"[{n.address}]:{n.port} {key[0]} {key[1]}")
        return lines

    def trust_host_keys(self):
        """Write the nodes' current host keys to the sim's known_hosts (what ssh reads) and to its block
        of the system known_hosts (what the containers' connection reads): what an operator does
        after checking a changed key."""
        lines = self.host_key_lines()
        self.known_hosts.write_text("".join(f"{line}\n" for line in lines))
        host.set_system_known_hosts(self.state_dir, lines)

    def to_json(self):
        data = asdict(self)
        data["state_dir"], data["inventory_path"] = str(self.state_dir), str(self.inventory_path)
        return json.dumps(data, indent=2) + "\n"

    def save(self):
        """Write sim.json, and its copy in the machine's registry of sims."""
        path = self.state_dir / STATE_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)
        host.register(self.state_dir, self.to_json())


def _node_files(sim_or_dir, name):
    state_dir = sim_or_dir.state_dir if isinstance(sim_or_dir, Sim) else sim_or_dir
    return node.NodeFiles(state_dir, name)


def load(state_dir=DEFAULT_STATE_DIR):
    """The sim whose state is in `state_dir`; SimError if none was brought up there."""
    path = Path(state_dir).resolve() / STATE_FILE
    problem = host.state_dir_problem(path.parent)
    if problem:  # what another user wrote there names no process of root's to stop and no path to remove
        raise SimError(f"the state dir is not trusted: {problem}")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SimError(f"no pvesim is up in {path.parent} (run `python -m pvesim up`)") from None
    return _from_record(data)


def _from_record(data):
    return Sim(state_dir=Path(data["state_dir"]), nodes=[SimNode(**n) for n in data["nodes"]],
               gpus=data["gpus"], inventory_path=Path(data["inventory_path"]), tag=data["tag"],
               passthrough={int(k): v for k, v in data.get("passthrough", {}).items()},
               compute_apps=data.get("compute_apps", {}), node_user=data.get("node_user"),
               network=data.get("network", "isolated"), sudo_rule=data.get("sudo_rule"),
               nvswitch=data.get("nvswitch", False), gpu_generation=data.get("gpu_generation", "hopper"))


def split_containers(containers, nodes):
    """Contiguous blocks: --nodes 2 --containers 200,201,202,203 gives pve1 200,201 and pve2 202,203."""
    per_node = -(-len(containers) // nodes)
    return [list(containers[i * per_node:(i + 1) * per_node]) for i in range(nodes)]


def gpu_layout(blocks, gpus, passthrough=None):
    """{vmid: node GPU indices} for every container: `passthrough` where it names one, else each node's
    GPUs split into equal contiguous shares among its containers (never two containers on one GPU)."""
    layout = {}
    for block in blocks:
        share = gpus // len(block) if block else 0
        for i, vmid in enumerate(block):
            layout[vmid] = list(range(i * share, (i + 1) * share))
    for vmid, indices in (passthrough or {}).items():
        if vmid not in layout:
            raise SimError(f"gpu_passthrough names container {vmid}, which is not in --containers")
        if any(not isinstance(i, int) or not 0 <= i < gpus for i in indices):
            raise SimError(f"gpu_passthrough of {vmid} must be GPU indices 0..{gpus - 1}, got {indices!r}")
        layout[vmid] = sorted(indices)
    return layout


def compute_apps_by_node(names, compute_apps):
    modes = compute_apps if isinstance(compute_apps, dict) else {name: compute_apps for name in names}
    for name in names:
        if modes.get(name, "host") not in COMPUTE_APPS:
            raise SimError(f"compute_apps must be one of {', '.join(COMPUTE_APPS)}, got {modes[name]!r}")
    return {name: modes.get(name, "host") for name in names}


def _validate(nodes, containers, gpus, state_dir):
    if not isinstance(nodes, int) or not 1 <= nodes <= 200:
        raise SimError(f"--nodes must be between 1 and 200, got {nodes!r}")
    if not containers:
        raise SimError("--containers must name at least one container id")
    for vmid in containers:
        if not isinstance(vmid, int) or not 100 <= vmid <= 999999999:
            raise SimError(f"container ids are integers from 100 to 999999999 (as in Proxmox), got {vmid!r}")
    if len(set(containers)) != len(containers):
        raise SimError(f"container ids must be unique, got {list(containers)}")
    if not isinstance(gpus, int) or not 0 <= gpus <= MAX_GPUS:
        raise SimError(f"--gpus must be between 0 and {MAX_GPUS}, got {gpus!r}")
    if str(state_dir) == "/" or any(c.isspace() for c in str(state_dir)):
        raise SimError(f"unusable state dir {str(state_dir)!r} (it must not be / or contain whitespace)")
    if os.geteuid() != 0:
        raise SimError("pvesim needs root (it runs sshd and LXC containers)")
    for tool in ("lxc-start", "lxc-attach", node.SSHD, "ssh-keygen", "ssh"):
        if not shutil.which(tool):
            raise SimError(f"{tool} not found: install lxc and openssh-server (`make setup`)")
    if _root_account_locked():
        raise SimError("root's password field in /etc/shadow starts with '!' (a locked account): the nodes' "
                       "sshd (UsePAM no) refuses key logins to locked accounts; unlock it without a password "
                       "with `usermod -p '*' root`")


def _root_account_locked():
    try:
        with open("/etc/shadow") as f:
            entry = next((line for line in f if line.startswith("root:")), "root::")
    except OSError:
        return False
    return entry.split(":")[1].startswith("!")


def _healthy(sim):
    for n in sim.nodes:
        if not procs.is_alive(n.sshd_pid, n.sshd_started) or not node.accepts(n.address, n.port):
            return False
    return True


def up(nodes=1, containers=(200,), gpus=8, state_dir=DEFAULT_STATE_DIR, inventory=DEFAULT_INVENTORY,
       gpu_passthrough=None, compute_apps="host", node_user=None, network="isolated", sudo_rule=None,
       nvswitch=False, gpu_generation="hopper"):
    """Bring up a sim (idempotent: a running sim with the same layout is left as it is).

    Each node has `gpus` physical GPUs. By default its containers get equal, disjoint shares of them;
    `gpu_passthrough` ({vmid: [node GPU index, ...]}) passes others through (two containers may share a
    GPU). `compute_apps` ("host" or "container", or {node name: either}) is the node's driver's
    compute-apps behaviour. `node_user` (a user name other than root) makes Ansible log in to the nodes as
    that user, a machine user pvesim makes, with production's sudo rule for /usr/sbin/pct
    (inventory/production.example/sudoers.d/ansible_pct) plus the sim's additions (host.sudo_rules), or the
    rules of the sudoers file `sudo_rule` (sudoers.d/ansible_pct.narrow, say) instead of production's.
    `network` is "isolated" (a container reaches nothing but itself) or
    "loopback" (containers reach each other at their own 127.x.y.z addresses, `Sim.address_of`).
    The nodes come up as their admin left them since boot: every NVIDIA device node made (as
    `nvidia-modprobe -c0 -u` and nvidia-smi make them); a reboot (`Sim.reboot_node`) makes none. `nvswitch`:
    HGX boards, whose CUDA fails (error 802) until the fabric manager of the driver's version runs; the
    nodes come up with it installed, enabled and running (pvesim.prerequisites.set_fabric_manager).
    `gpu_generation`: "hopper" (NVIDIA H200: `nvidia-smi -q` shows each GPU's Fabric State) or "ampere"
    (NVIDIA A100-SXM4-80GB: no Fabric section; an NVSwitch board's switches are seen by lspci only)."""
    containers = list(containers)
    if gpu_generation not in container.GPU_GENERATIONS:
        raise SimError(f"gpu_generation must be one of {', '.join(container.GPU_GENERATIONS)}, "
                       f"got {gpu_generation!r}")
    if network not in container.LXC_NETWORK:
        raise SimError(f"network must be one of {', '.join(container.LXC_NETWORK)}, got {network!r}")
    state_dir = Path(state_dir).resolve()
    inventory = Path(inventory).resolve()
    _validate(nodes, containers, gpus, state_dir)
    if node_user is not None and (not host.USER_NAME.match(str(node_user)) or node_user == "root"):
        raise SimError(f"node_user must be a user name other than root, got {node_user!r}")
    if sudo_rule is not None:
        if node_user is None:
            raise SimError("sudo_rule is the node user's sudo rule: give node_user too")
        sudo_rule = str(Path(sudo_rule).resolve())
        if not Path(sudo_rule).is_file():
            raise SimError(f"sudo_rule {sudo_rule} is not a file")
    layout = gpu_layout(split_containers(containers, nodes), gpus, gpu_passthrough)
    modes = compute_apps_by_node([f"pve{i + 1}" for i in range(nodes)], compute_apps)
    with host.machine_lock():
        host.ensure_state_dir(state_dir)  # before anything in it is read or written
        if (state_dir / STATE_FILE).exists():
            current = load(state_dir)
            same = ([n.containers for n in current.nodes] == split_containers(containers, nodes)
                    and current.gpus == gpus and current.inventory_path == inventory
                    and current.passthrough == layout and current.compute_apps == modes
                    and current.node_user == node_user and current.network == network
                    and current.sudo_rule == sudo_rule and current.nvswitch == bool(nvswitch)
                    and current.gpu_generation == gpu_generation)
            if same and _healthy(current):
                # Nothing to start but what was stopped; shared files and the inventory are refreshed
                # in case something removed them.
                host.install_pct()
                host.register(state_dir, current.to_json())
                _install_node_user(current)
                _ensure_running(current)
                if not current.inventory_path.exists():
                    write_inventory(current)
                return current
            if not same and _healthy(current):
                raise SimError(f"a sim with another layout is up in {state_dir}: run "
                               f"`python -m pvesim down --state-dir {state_dir}` first")
            _down_locked(state_dir)  # a half-dead sim: start over
        try:
            return _up_locked(nodes, containers, gpus, state_dir, inventory, layout, modes, node_user,
                              network, sudo_rule, bool(nvswitch), gpu_generation)
        except BaseException:
            _down_locked(state_dir)
            raise


def _up_locked(nodes, containers, gpus, state_dir, inventory, layout, modes, node_user, network,
               sudo_rule=None, nvswitch=False, gpu_generation="hopper"):
    tag = host.sim_tag(state_dir)
    host.ensure_state_dir(state_dir)
    sim = Sim(state_dir=state_dir, gpus=gpus, inventory_path=inventory, tag=tag, passthrough=layout,
              compute_apps=modes, node_user=node_user, network=network, sudo_rule=sudo_rule,
              nvswitch=nvswitch, gpu_generation=gpu_generation,
              nodes=[SimNode(name=f"pve{i + 1}", address=node.node_address(i), port=0, containers=block)
                     for i, block in enumerate(split_containers(containers, nodes))])
    # Saved (and registered) before anything starts, so that `down` finds whatever a crash leaves.
    sim.save()
    host.install_pct()
    client_key = node.keygen(sim.private_key, "pvesim")
    authorized_keys = sim.authorized_keys
    authorized_keys.write_text(" ".join(client_key) + " pvesim\n")
    for n in sim.nodes:
        files = _node_files(sim, n.name)
        gpus_of_node = container.node_gpus(tag, n.name, gpus, gpu_generation)
        n.port = node.free_port(n.address)
        node.write_node(files, n.address, n.port, authorized_keys,
                        container.node_gpu_state(state_dir, n.name, gpus_of_node, modes[n.name], nvswitch,
                                                 gpu_generation),
                        node_user)
        node.new_boot(files, gpus, prepared=True)
        n.sshd_pid, n.sshd_started = node.start_sshd(files, n.address, n.port)
        sim.save()
        for vmid in n.containers:
            container.write_container(files, tag, vmid, layout[vmid], network)
    _install_node_user(sim)
    sim.trust_host_keys()
    for n in sim.nodes if nvswitch else ():
        prerequisites.set_fabric_manager(sim, n.name, container.DRIVER_VERSION)
    _ensure_running(sim)
    write_inventory(sim)
    return sim


def _install_node_user(sim):
    """The sim's node user (made if missing), the sim's key in its authorized_keys, its sudo rules."""
    if not sim.node_user:
        return
    host.ensure_node_user(sim.node_user)
    host.authorize_node_user(sim.state_dir, sim.node_user, sim.authorized_keys.read_text().strip())
    host.install_sudo_rules(sim.state_dir, sim.node_user,
                            [_node_files(sim, n.name).bin / tool for n in sim.nodes
                             for tool in ("nvidia-smi", "lsmod", "lspci")], sim.sudo_rule)


def _ensure_running(sim):
    """Start every container that is not running, through the node's own pct."""
    for n in sim.nodes:
        files = _node_files(sim, n.name)
        env = {**os.environ, **files.session_env()}
        for vmid in n.containers:
            if container.state(files, vmid) != "RUNNING":
                res = subprocess.run([str(host.PCT_PATH), "start", str(vmid)], env=env,
                                     capture_output=True, text=True, stdin=subprocess.DEVNULL)
                if res.returncode != 0:
                    raise SimError(f"container {vmid} on {n.name} did not start: {res.stderr.strip()}")


def container_hostvars(sim, node_name, vmid):
    """The inventory entry of a container on a node of the sim (also one the sim does not have yet,
    for a provisioning playbook to create)."""
    n = sim.node(node_name)
    return {
        "ansible_connection": CONNECTION,
        "ansible_host": n.address, "ansible_port": n.port, "ansible_user": sim.node_user or "root",
        "ansible_private_key_file": str(sim.private_key), "proxmox_vmid": vmid,
        "ansible_python_interpreter": NODE_PYTHON, "pvesim_node": n.name,
        # A container's root is an overlay over the controller's /: the Python that brought the sim up
        # (the project's venv) and its site-packages are visible inside (whichever Ansible runs the play).
        "pvesim_python": sys.executable,
        "pvesim_site_packages": sysconfig.get_paths()["purelib"],
        **({"pvesim_address": sim.address_of(vmid)} if sim.network == "loopback" else {}),
    }


def inventory_data(sim):
    ssh_args = f"-o UserKnownHostsFile={sim.known_hosts} -o StrictHostKeyChecking=yes"
    node_hosts, container_hosts = {}, {}
    # A node user runs pct through sudo: the node checks because proxmox_host_pct_sudo follows the node's
    # ansible_user, the containers' connection because its remote user is not root (production.example).
    user = sim.node_user or "root"
    for n in sim.nodes:
        node_hosts[n.name] = {
            "ansible_host": n.address, "ansible_port": n.port, "ansible_user": user,
            "ansible_ssh_private_key_file": str(sim.private_key), "ansible_ssh_common_args": ssh_args,
            "ansible_python_interpreter": NODE_PYTHON,
        }
        for vmid in n.containers:
            container_hosts[f"ct{vmid}"] = container_hostvars(sim, n.name, vmid)
    return {"all": {"children": {"proxmox_hosts": {"hosts": node_hosts},
                                 "training_containers": {"hosts": container_hosts}}}}


def write_inventory(sim):
    sim.inventory_path.parent.mkdir(parents=True, exist_ok=True)
    text = INVENTORY_HEADER.format(state_dir=sim.state_dir) + "---\n"
    text += yaml.safe_dump(inventory_data(sim), sort_keys=False, default_flow_style=False, width=1000)
    sim.inventory_path.write_text(text)


def down(state_dir=DEFAULT_STATE_DIR):
    """Stop and remove everything the sim in `state_dir` started and installed (also after a crash)."""
    with host.machine_lock():
        _down_locked(Path(state_dir).resolve())


def down_all(checkout_only=False):
    """Bring down every registered sim (and the default one); `checkout_only`: only those this checkout's
    pvesim brought up (its nodes' provision.json names this package), so that a CI run's last step leaves
    another checkout's suite running on the machine alone."""
    with host.machine_lock():
        for state_dir in {*host.registered_state_dirs(), DEFAULT_STATE_DIR}:
            if not checkout_only or _brought_up_here(state_dir):
                _down_locked(state_dir)


def _brought_up_here(state_dir):
    for provision in Path(state_dir).glob("nodes/*/provision.json"):
        try:
            if json.loads(provision.read_text()).get("path") == str(REPO_ROOT):
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def _down_locked(state_dir):
    try:
        sim = load(state_dir)
    except (SimError, ValueError, KeyError, TypeError):
        record = host.registered_record(state_dir)  # the state dir may be gone: the registry's copy
        sim = _from_record(record) if record else None
    recorded = {n.name: n for n in sim.nodes} if sim else {}
    nodes_dir = state_dir / "nodes"
    names = {p.name for p in nodes_dir.iterdir()} if nodes_dir.is_dir() else set()
    for name in sorted(names | set(recorded)):
        files = _node_files(state_dir, name)
        # Containers first (what a node's sessions started inside them dies with them), then sshd.
        vmids = {p.name for p in files.lxcpath.iterdir()} if files.lxcpath.is_dir() else set()
        for vmid in sorted(vmids):
            container.destroy(files, vmid)
        n = recorded.get(name)
        node.stop_sshd(files, n.sshd_pid if n else None, n.sshd_started if n else None)
        if files.root.is_dir():
            shutil.rmtree(files.root)
    if nodes_dir.is_dir():
        nodes_dir.rmdir()
    host.remove_cgroups(host.sim_tag(state_dir))
    host.remove_system_known_hosts(state_dir)
    shutil.rmtree(host.node_tools_dir(state_dir), ignore_errors=True)
    shutil.rmtree(host.KEYS / host.sim_tag(state_dir), ignore_errors=True)
    host.remove_sudo_rules(state_dir)
    if sim and sim.node_user:
        host.unauthorize_node_user(state_dir, sim.node_user)
    inventory = sim.inventory_path if sim else None
    if inventory and inventory.is_file() and \
            inventory.read_text().startswith(INVENTORY_HEADER.format(state_dir=state_dir)):
        inventory.unlink()
    for name in ("id_ed25519", "id_ed25519.pub", "known_hosts", "authorized_keys", STATE_FILE,
                 STATE_FILE.replace(".json", ".tmp")):
        (state_dir / name).unlink(missing_ok=True)
    if state_dir.is_dir() and not any(state_dir.iterdir()):
        state_dir.rmdir()
    host.unregister(state_dir)
    host.remove_shared_files_if_unused()
