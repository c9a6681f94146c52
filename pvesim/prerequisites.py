"""A node's prerequisites as pvesim models them, and faults in them on demand: its Proxmox VE version, its
NVIDIA driver's nvidia_uvm module and device nodes, the fabric manager of an NVSwitch node, and the
appliance index `pveam available` lists. The node's tools (pvesim/bin/pve-node-tools: pveversion, pveam,
lsmod; nvidia-modprobe, systemctl, nv-fabricmanager) read what these write; the template and the NVIDIA
installer are plain files on the node's storage (node.NodeFiles.template_cache, .snippets).
docs/PVESIM.md lists each with the real behaviour it follows."""

import json
import shutil
from pathlib import Path

from . import node

# Read by pve-node-tools (the same name and default there): the node's PVE::pvecfg version_text (a
# current 8.x node's by default).
VERSION_FILE = "pve-manager.version"
DEFAULT_VERSION = "8.2.4/faa83925c9641325"
# The fabric manager's unit as NVIDIA's nvidia-fabricmanager package ships it, its ExecStart= a bare name
# (pvesim's nv-fabricmanager is in the node's bin, not /usr/bin).
FABRIC_MANAGER_UNIT = """\
[Unit]
Description=NVIDIA fabric manager service
After=network-online.target
Requires=network-online.target

[Service]
User=root
PrivateTmp=false
Type=forking
ExecStart=nv-fabricmanager -c /usr/share/nvidia/nvswitch/fabricmanager.cfg
LimitCORE=infinity

[Install]
WantedBy=multi-user.target
"""


def set_pve_version(sim, node_name, version_text):
    """What the node's pveversion reports: `version_text` is PVE::pvecfg's, e.g. "8.0.4/d258a813"."""
    (node.NodeFiles(sim.state_dir, node_name).bin / VERSION_FILE).write_text(f"{version_text}\n")


def _on_node(sim, node_name, command):
    res = sim.ssh(node_name, command)
    if res.returncode != 0:
        raise RuntimeError(f"{command!r} on {node_name} failed: {res.stderr.strip()}")
    return res.stdout


def set_nvidia_uvm(sim, node_name, loaded):
    """The node with nvidia-uvm loaded or not since its boot: without it lsmod lists no nvidia_uvm and the
    node has no /dev/nvidia-uvm, /dev/nvidia-uvm-tools, so a container passing them through fails to start
    (`Device ... does not exist`); with it, as `nvidia-modprobe -u -c0` leaves the node."""
    if loaded:
        _on_node(sim, node_name, "nvidia-modprobe -u -c0")
        return
    _on_node(sim, node_name, "rm -f /dev/nvidia-uvm /dev/nvidia-uvm-tools")
    modules = node.NodeFiles(sim.state_dir, node_name).dev_current / "modules"
    modules.write_text("".join(f"{m}\n" for m in modules.read_text().split() if m != "nvidia_uvm"))


def remove_device_nodes(sim, node_name):
    """The node as after a boot where nothing made its NVIDIA device nodes (no nvidia-modprobe, nvidia-smi
    or CUDA program ran), without a reboot."""
    _on_node(sim, node_name, "rm -f /dev/nvidia[0-9]* /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools")


def set_fabric_manager(sim, node_name, version, running=True, enabled=True):
    """NVIDIA's fabric manager on the node: `version` installed (None: not installed), its unit enabled
    at boot or not, started now or not (a version other than the driver's fails to start)."""
    files = node.NodeFiles(sim.state_dir, node_name)
    tool = files.bin / "nv-fabricmanager"
    if version is None:
        tool.unlink(missing_ok=True)
        _on_node(sim, node_name, "rm -f /etc/systemd/system/nvidia-fabricmanager.service "
                 "/etc/systemd/system/multi-user.target.wants/nvidia-fabricmanager.service")
        return
    (files.bin / "nv-fabricmanager.version").write_text(f"{version}\n")
    shutil.copyfile(Path(__file__).resolve().parent / "bin" / "nv-fabricmanager", tool)
    tool.chmod(0o755)
    _on_node(sim, node_name, f"cat > /etc/systemd/system/nvidia-fabricmanager.service <<'EOF'\n"
             f"{FABRIC_MANAGER_UNIT}EOF\n"
             + ("systemctl enable nvidia-fabricmanager\n" if enabled else
                "systemctl disable nvidia-fabricmanager\n"))
    if running:
        sim.ssh(node_name, "systemctl start nvidia-fabricmanager")


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
