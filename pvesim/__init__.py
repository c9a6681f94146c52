"""pvesim: a local Proxmox with real sshd and real LXC, the test bed of dflash-ops.

    sim = pvesim.up(nodes=2, containers=(200, 201, 202, 203), gpus=8, state_dir="/tmp/sim")
    sim.ssh("pve1", "pct list")
    pvesim.down("/tmp/sim")
"""

from .sim import DEFAULT_INVENTORY, DEFAULT_STATE_DIR, Sim, SimError, SimNode, down, down_all, load, up

__all__ = ["DEFAULT_INVENTORY", "DEFAULT_STATE_DIR", "Sim", "SimError", "SimNode", "down", "down_all", "load",
           "up"]
