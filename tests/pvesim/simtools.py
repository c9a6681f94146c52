"""Small helpers for the pvesim tests."""

import importlib.machinery
import importlib.util
import os
import shlex
from pathlib import Path

BIN = Path(__file__).resolve().parents[2] / "pvesim" / "bin"


def load_script(name):
    """Import one of pvesim's installed scripts (they have no .py suffix) as a module."""
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), str(BIN / name))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def in_ct(vmid, *argv):
    """The node-side command line running argv in a container, quoted for the node's shell."""
    return f"pct exec {vmid} -- {shlex.join(argv)}"


def host_pid(init_pid, container_pid):
    """The host pid of a container process: same PID namespace as the container's init, NSpid ending
    with the pid the container sees."""
    pidns = os.readlink(f"/proc/{init_pid}/ns/pid")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") != pidns:
                continue
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        nspid = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:"))
        if nspid[-1] == str(container_pid):
            return int(entry)
    return None


def lone_node(tmp_path_factory, name, containers, gpus):
    """A sim of one node with `containers` of its own, which a test module may change; bring it down
    with pvesim.down(sim.state_dir)."""
    import pvesim

    return pvesim.up(nodes=1, containers=containers, gpus=gpus,
                     state_dir=tmp_path_factory.mktemp(name) / "state",
                     inventory=tmp_path_factory.mktemp(f"{name}-inv") / "hosts.yml")


def container_conf(sim, vmid, node="pve1"):
    """The node's config file of container `vmid` (what pct reads and writes)."""
    return sim.state_dir / "nodes" / node / "pve" / "lxc" / f"{vmid}.conf"
