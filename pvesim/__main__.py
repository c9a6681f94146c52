"""python -m pvesim up|down|status: a local Proxmox with real sshd and real LXC."""

import argparse
import os
import sys
from pathlib import Path

from . import container, driver, host, node
from .sim import COMPUTE_APPS, DEFAULT_INVENTORY, DEFAULT_STATE_DIR, SimError, down, down_all, load, up


def container_ids(text):
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected container ids like 200,201, got {text!r}") from None


def parser():
    p = argparse.ArgumentParser(prog="python -m pvesim",
                                description="A local Proxmox: real sshd per node, real LXC containers, "
                                            "a pct at /usr/sbin/pct and simulated GPUs.")
    sub = p.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="bring up nodes and containers and write the inventory (idempotent)")
    p_up.add_argument("--nodes", type=int, default=1, help="number of nodes, pve1..pveN (default 1)")
    p_up.add_argument("--containers", type=container_ids, default=[200],
                      help="container ids, spread over the nodes in contiguous blocks (default 200)")
    p_up.add_argument("--gpus", type=int, default=8, help="simulated GPUs per node (default 8)")
    p_up.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                      help=f"where this sim keeps its state (default {DEFAULT_STATE_DIR})")
    p_up.add_argument("--inventory", type=Path, default=DEFAULT_INVENTORY,
                      help="the Ansible inventory to write (default inventory/sim/hosts.yml)")
    p_up.add_argument("--compute-apps", choices=COMPUTE_APPS, default="host",
                      help="the nodes' driver: 'host' lists every process with host PIDs in a container, "
                           "'container' only the container's own (default host)")
    p_up.add_argument("--node-user", help="log in to the nodes as this user (made if missing), with the sudo "
                                          "rule for /usr/sbin/pct, instead of root")
    p_up.add_argument("--sudo-rule", type=Path,
                      help="with --node-user: the user's sudo rules from this sudoers file instead of "
                           "production's (e.g. inventory/production.example/sudoers.d/ansible_pct.narrow)")
    p_up.add_argument("--network", choices=("isolated", "loopback"), default="isolated",
                      help="isolated: each container reaches only itself (default); loopback: containers "
                           "reach each other at their own 127.x.y.z addresses (net0)")
    p_up.add_argument("--nvswitch", action="store_true",
                      help="HGX boards: the GPUs behind NVSwitches, CUDA failing (error 802) until NVIDIA "
                           "Fabric Manager of the driver's version runs (installed, enabled and running)")
    p_up.add_argument("--gpu-generation", choices=tuple(container.GPU_GENERATIONS), default="hopper",
                      help="hopper: NVIDIA H200, nvidia-smi -q shows each GPU's Fabric State (default); "
                           "ampere: NVIDIA A100-SXM4-80GB, no Fabric section (lspci shows the NVSwitches)")
    p_down = sub.add_parser("down", help="stop and remove everything a sim started (also after a crash)")
    which = p_down.add_mutually_exclusive_group()
    which.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                       help=f"the sim to bring down (default {DEFAULT_STATE_DIR})")
    which.add_argument("--all", action="store_true", help="bring down every sim on this machine")
    which.add_argument("--checkout", action="store_true",
                       help="bring down every sim this checkout's pvesim brought up (a test suite's, "
                            "whatever its state dirs), and no other checkout's")
    p_ssh = sub.add_parser("ssh", help="open ssh to a node as root (or run a command there)")
    p_ssh.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                       help=f"the sim (default {DEFAULT_STATE_DIR})")
    p_ssh.add_argument("node", help="node name, e.g. pve1")
    p_ssh.add_argument("remote_command", nargs=argparse.REMAINDER, help="command to run on the node")
    p_reboot = sub.add_parser("reboot", help="reboot a node: stop every container, start those with onboot")
    p_reboot.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                          help=f"the sim (default {DEFAULT_STATE_DIR})")
    p_reboot.add_argument("node", help="node name, e.g. pve1")
    p_kernel = sub.add_parser("kernel-update", help="a new proxmox-kernel on a node, as apt full-upgrade "
                              "brings it (DKMS builds the driver for it only when registered)")
    p_kernel.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                          help=f"the sim (default {DEFAULT_STATE_DIR})")
    p_kernel.add_argument("--version", help="the kernel, e.g. 6.8.12-5-pve (default: the newest's next ABI)")
    p_kernel.add_argument("node", help="node name, e.g. pve1")
    p_driver = sub.add_parser("driver-update", help="NVIDIA's installer of another driver version put on "
                              "a node's storage and run there (sh ...run --dkms --silent)")
    p_driver.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                          help=f"the sim (default {DEFAULT_STATE_DIR})")
    p_driver.add_argument("--version", required=True, help="the driver's version, e.g. 550.144.03")
    p_driver.add_argument("--no-dkms", action="store_true",
                          help="install it without registering it with DKMS")
    p_driver.add_argument("node", help="node name, e.g. pve1")
    p_status = sub.add_parser("status", help="print the nodes and containers of the sims that are up")
    p_status.add_argument("--state-dir", type=Path, help="only this sim (default: every sim that is up)")
    return p


def print_status(state_dirs):
    if not state_dirs:
        print("no pvesim is up")
        return 1
    for state_dir in state_dirs:
        sim = load(state_dir)
        print(f"pvesim {sim.state_dir}: {len(sim.nodes)} node(s), {sim.gpus} GPU(s) per node, "
              f"inventory {sim.inventory_path}")
        for n in sim.nodes:
            files = node.NodeFiles(sim.state_dir, n.name)
            listening = "up" if node.accepts(n.address, n.port) else "DOWN"
            print(f"  {n.name:<6} {n.address}:{n.port:<6} sshd pid {n.sshd_pid} {listening}")
            for vmid in n.containers:
                state = (container.state(files, vmid) or "missing").lower()
                init = container.init_pid(files, vmid)
                address = f"  {sim.address_of(vmid)}" if sim.network == "loopback" else ""
                print(f"    CT {vmid:<8} {state:<8} ct{vmid}  init pid {init}{address}")
    return 0


def main(argv=None):
    args = parser().parse_args(argv)
    try:
        if args.command == "up":
            sim = up(nodes=args.nodes, containers=args.containers, gpus=args.gpus, state_dir=args.state_dir,
                     inventory=args.inventory, compute_apps=args.compute_apps, node_user=args.node_user,
                     network=args.network, sudo_rule=args.sudo_rule, nvswitch=args.nvswitch,
                     gpu_generation=args.gpu_generation)
            return print_status([sim.state_dir])
        if args.command == "down":
            if args.all or args.checkout:
                down_all(checkout_only=args.checkout)
            else:
                down(args.state_dir)
            return 0
        if args.command == "ssh":
            argv = load(args.state_dir).ssh_argv(args.node)
            remote = args.remote_command
            os.execvp(argv[0], argv + (remote[1:] if remote[:1] == ["--"] else remote))
        if args.command == "reboot":
            print(load(args.state_dir).reboot_node(args.node), end="")
            return print_status([args.state_dir])
        if args.command == "kernel-update":
            kernel = driver.kernel_update(load(args.state_dir), args.node, args.version)
            print(f"{args.node}: proxmox-kernel {kernel} installed, the default at the next boot "
                  "(python -m pvesim reboot)")
            return 0
        if args.command == "driver-update":
            options = ("--no-dkms", "--silent") if args.no_dkms else ()
            res = driver.driver_update(load(args.state_dir), args.node, args.version, *options)
            print(res.stdout + res.stderr, end="")
            return res.returncode
        if args.state_dir:
            return print_status([args.state_dir])
        return print_status([d for d in host.registered_state_dirs() if (d / "sim.json").exists()])
    except SimError as e:
        print(f"pvesim: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
