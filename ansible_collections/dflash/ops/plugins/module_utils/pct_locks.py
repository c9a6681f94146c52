# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What a container's config `lock:` and the HA manager forbid, read in one place for every module that
starts, stops, changes or destroys a container, with what to do about each.

pve-container refuses `pct start`, `set`, `shutdown`, `stop` and `destroy` of a container whose config
has a `lock:` ("CT is locked (backup)": pve-guest-common's AbstractConfig.pm check_lock, called by
API2/LXC/Status.pm, API2/LXC/Config.pm and API2/LXC.pm), but not `pct exec` (CLI/pct.pm exec reads no
lock). A boot's startall removes only a left-over `backup` lock (pve-manager's API2/Nodes.pm). For a
container the HA manager manages (pve-ha-manager's /etc/pve/ha/resources.cfg), `pct start`, `shutdown` and
`stop` only queue a request with the HA manager and return (API2/LXC/Status.pm: `vm_is_ha_managed`).
"""

from __future__ import annotations

import json
import re

from ansible_collections.dflash.ops.plugins.module_utils.pct_cli import CheckFailed

# What to do about each lock pve-container sets (LXC/Config.pm's lock types), `{vmid}` the container.
LOCK_ADVICE = {
    "backup": ("a backup (vzdump) of it is running: wait for it to end, then run this again (its task on the "
               "node, or `vzdump --stop 1` there to end it). A backup killed outright leaves the lock, which "
               "the node's next boot removes"),
    "create": ("a `pct create {vmid}` did not finish (killed or failed half-way), or is still running: once "
               "no `pct create {vmid}` runs on the node, `pct unlock {vmid}` and `pct destroy {vmid}` there "
               "remove the half-made container, and provisioning creates it again"),
    "mounted": "`pct mount {vmid}` left its disks mounted on the node: `pct unmount {vmid}` there",
    "destroyed": "a `pct destroy {vmid}` is removing it",
}
DEFAULT_ADVICE = ("a Proxmox task ({lock}: a migration, snapshot, rollback or disk move) holds it: wait for "
                  "that task to end (the node's task log)")
# What pct prints when it passes a start or stop to the HA manager instead of doing it.
HA_REQUEST = re.compile(r"^Requesting HA (start|stop) for CT \d+", re.MULTILINE)


def config_lock(options):
    """The `lock:` of a container's config (the options of `pct config`), or None."""
    return options.get("lock") or None


def advice(vmid, lock):
    return LOCK_ADVICE.get(lock, DEFAULT_ADVICE).format(vmid=vmid, lock=lock)


def lock_refusal(vmid, node, lock, needed):
    """The failure of a step that needs what a lock forbids (`needed`: `pct start`, say), before it ran."""
    return (f"CT {vmid} on node {node} is locked ({lock}): pve-container refuses {needed} until the lock "
            f"goes, so nothing was changed. {advice(vmid, lock)[0].upper()}{advice(vmid, lock)[1:]}.")


def lock_warning(vmid, node, lock, going_on="the run's stop and start go on through pct exec"):
    """What a step that needs only `pct exec` (`going_on`: the run's stop and start in the container) says
    as it goes on."""
    return (f"CT {vmid} on node {node} is locked ({lock}): {going_on}, which no lock refuses, but pct start, "
            f"shutdown, set and destroy of it are refused until the lock goes ({advice(vmid, lock)}).")


def ha_state(pct, vmid):
    """The HA manager's state of the container (`hastate` of `pvesh get /cluster/resources`: started,
    stopped, ...), None when HA does not manage it or pvesh cannot be asked (then pct's own answer tells:
    HA_REQUEST)."""
    answer = pct.tool("pvesh", "get", "/cluster/resources", "--type", "vm", "--output-format", "json")
    if answer.rc != 0:
        return None
    try:
        guests = json.loads(answer.stdout)
    except ValueError:
        return None
    return next((g.get("hastate") for g in guests if isinstance(g, dict) and g.get("vmid") == vmid), None)


def ha_destroy_refusal(vmid, node, hastate):
    """The failure of a destroy of an HA resource (API2/LXC.pm destroy_vm: `used in HA resources and purge
    parameter not set`; its shutdown would only queue a request)."""
    return (f"CT {vmid} on node {node} is an HA resource (its HA state: {hastate}): pct destroy refuses it "
            "without --purge, and its shutdown would only queue a request with the HA manager, so nothing "
            f"was changed. Take it out of HA first (`ha-manager remove ct:{vmid}` on the node).")


def ha_refusal(vmid, node, needed, hastate=None, queued=None):
    """The failure of a start or stop of an HA-managed container: pct would only queue a request (or, as
    `queued` says in pct's words, did)."""
    state = f" (its HA state: {hastate})" if hastate else ""
    did = (f"{needed} only queued a request with it ({queued}) and returned: the container is not running. "
           if queued else f"{needed} only queues a request with it and returns, so this does not do it. ")
    return (f"CT {vmid} on node {node} is managed by the HA manager{state}: {did}Start or stop it through HA "
            f"(`ha-manager set ct:{vmid} --state started` or `--state stopped` on the node, then wait for "
            f"`ha-manager status`), or take it out of HA (`ha-manager remove ct:{vmid}`) for provisioning "
            "and the node checks to manage it.")


def needed_steps(vmid, params, settable, running):
    """The pct commands provisioning an existing container runs (`params`: proxmox_container's): pct set
    for a reconcile (a shutdown and a start when a running container's passthrough or mounts change), pct
    start for a stopped one."""
    steps = []
    if settable and params["reconcile"]:
        steps.append(f"pct set {vmid}")
        if running and any(d["key"].startswith(("dev", "mp")) for d in settable):
            steps += [f"pct shutdown {vmid}", f"pct start {vmid}"]
    if not running and params["start"]:
        steps.append(f"pct start {vmid}")
    return steps


def check_lock_and_ha(vmid, node, lock, hastate, steps, result):
    """Refuse, before anything runs, the steps a lock (any step; every step for a half-made container's
    `create` lock) or the HA manager (a start or shutdown) would refuse or only queue; a lock that forbids
    nothing needed is a warning."""
    if lock and (steps or lock == "create"):
        raise CheckFailed(lock_refusal(vmid, node, lock, " or ".join(steps) or f"pct start, set and destroy "
                                       f"of CT {vmid}"))
    power = [step for step in steps if step.startswith(("pct start", "pct shutdown"))]
    if hastate and power:
        raise CheckFailed(ha_refusal(vmid, node, " and ".join(power), hastate))
    if lock:
        result["warnings"].append(lock_warning(vmid, node, lock, "provisioning changes nothing of its config "
                                               "and goes on in it through pct exec"))
