"""pvesim: a local Proxmox with real sshd and real LXC, the test bed of dflash-ops.

    sim = pvesim.up(nodes=2, containers=(200, 201, 202, 203), gpus=8, state_dir="/tmp/sim")
    sim.ssh("pve1", "pct list")
    pvesim.down("/tmp/sim")

Faults on demand, each undone by its pair: `sim.stop_node("pve2")` / `sim.start_node("pve2")` (the
node's sshd: unreachable, its containers go on), `sim.rotate_host_key("pve1")` / `sim.trust_host_keys()`
(a new host key that no known_hosts file holds until trusted), `sim.hide_on_node("pve1",
["/usr/sbin/pct"])` / `sim.hide_on_node("pve1", [])` (paths that do not exist for the node's sessions).
"""

from .sim import DEFAULT_INVENTORY, DEFAULT_STATE_DIR, Sim, SimError, SimNode, down, down_all, load, up

__all__ = ["DEFAULT_INVENTORY", "DEFAULT_STATE_DIR", "Sim", "SimError", "SimNode", "down", "down_all", "load",
           "up"]
