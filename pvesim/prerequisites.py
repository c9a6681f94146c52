"""A node's prerequisites as pvesim models them, and faults in them on demand: its Proxmox VE version, its
NVIDIA driver's nvidia_uvm module, and the appliance index `pveam available` lists. The node's
tools (pvesim/bin/pve-node-tools: pveversion, pveam, lsmod) read what these write; the template and the
NVIDIA installer are plain files on the node's storage (node.NodeFiles.template_cache, .snippets).
docs/PVESIM.md lists each with the real behaviour it follows."""

import fcntl
import json

from . import node

# Read by pve-node-tools (the same name and default there): the node's PVE::pvecfg version_text (a
# current 8.x node's by default).
VERSION_FILE = "pve-manager.version"
DEFAULT_VERSION = "8.2.4/faa83925c9641325"
# The device nodes the driver's nvidia-uvm module makes (CUDA needs them; pct start checks passthrough of
# them against the node's devices).
UVM_DEVICES = ("/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


def set_pve_version(sim, node_name, version_text):
    """What the node's pveversion reports: `version_text` is PVE::pvecfg's, e.g. "8.0.4/d258a813"."""
    (node.NodeFiles(sim.state_dir, node_name).bin / VERSION_FILE).write_text(f"{version_text}\n")


def set_nvidia_uvm(sim, node_name, loaded):
    """The node with nvidia-uvm loaded or not: without it lsmod lists no nvidia_uvm and the node has no
    /dev/nvidia-uvm, so a container passing it through fails to start (`Device ... does not exist`)."""
    state = node.NodeFiles(sim.state_dir, node_name).gpu_state
    with open(f"{state}.lock", "w") as lock:  # pct's lock on the node's GPU state
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = json.loads(state.read_text())
        others = [d for d in data["devices"] if d not in UVM_DEVICES]
        data["devices"] = others + list(UVM_DEVICES) if loaded else others
        tmp = state.with_name(f"{state.name}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(state)


def move_template_index(sim, node_name=None):
    """The appliance index moved on, as `pveam update` finds it one day: the newer debian-12-standard
    (node.NEWER_TEMPLATE) replaces the old one in each node's index (or `node_name`'s only). What the
    storages hold stays; `pveam download` of the old name is refused from then on."""
    for name in [node_name] if node_name else [n.name for n in sim.nodes]:
        files = node.NodeFiles(sim.state_dir, name)
        index = json.loads(files.template_index.read_text())
        index["system"] = sorted([t for t in index["system"] if not t.startswith("debian-12-standard_")]
                                 + [node.NEWER_TEMPLATE])
        files.template_index.write_text(json.dumps(index))
