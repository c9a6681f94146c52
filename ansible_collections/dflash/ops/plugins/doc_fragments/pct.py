# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
from __future__ import annotations


class ModuleDocFragment:
    """The options of the modules that run pct on the Proxmox VE node (module_utils.pct_cli.PCT_ARGUMENTS)."""

    DOCUMENTATION = r"""
options:
  vmid:
    description: The container's CT id.
    type: int
    required: true
  node_name:
    description: The node's name in messages (the inventory name). Default the machine's host name.
    type: str
  pct_argv:
    description:
      - The command that runs pct, as an argv prefix; its last element is pct's path, named in
        messages.
      - A non-root node user runs pct through sudo, for example V([sudo, -n, /usr/sbin/pct]).
    type: list
    elements: str
    default: [/usr/sbin/pct]
attributes:
  action_group:
    description: Use C(group/dflash.ops.pct) in C(module_defaults) to set defaults for this module.
    support: full
    membership:
      - dflash.ops.pct
"""
