# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Ansible plugins keep their imports below the documentation blocks.
# ruff: noqa: E402
from __future__ import annotations

DOCUMENTATION = r"""
---
name: preflight
author: dflash-ops contributors (@dflash-ops)
version_added: "0.3.0"
short_description: The training containers' inventory and variables checked before any connection
description:
  - Runs the checks of C(playbooks/preflight.yml) (every family, or the one O(check) names) for the training
    containers of a play, on the controller, from the inventory alone; nothing is connected to.
  - Returns one line per container with problems, its name, a colon and the sentences, each naming the
    variable, its value and the fix; an empty list when there is none.
  - One call checks the whole play (the playbook runs it once, not once per container); the argument
    spec validator is built once and each container's variables are read once.
options:
  _input:
    description: The inventory names of the training containers (one name is a list of one).
    type: list
    elements: str
    required: true
  check:
    description:
      - The family of checks to run; all of them, in this order, when omitted.
      - V(inventory) - C(proxmox_vmid), C(proxmox_node), C(ansible_connection), and the container's
        C(ansible_host) and C(ansible_port), which must be its node's.
      - V(run_members) - a run across containers (C(dflash_run_members)) is declared alike on all its
        members, each has a C(dflash_run_address), and the play includes every member.
      - V(variable_types) - the role variables set for the container have the types of O(specs).
      - V(variable_names) - every variable named like a role's (C(<role>_...)) is an option of O(specs).
      - V(run_name_and_paths) - C(dflash_run_name) is a plain file name, and the role variables that are
        paths in the container or on its node are absolute.
    type: str
    choices: [inventory, run_members, variable_types, variable_names, run_name_and_paths]
  hostvars:
    description: The play's C(hostvars).
    type: dict
    required: true
  groups:
    description: The inventory's C(groups) (for V(inventory) and V(run_members)).
    type: dict
  play_hosts:
    description: The hosts of the play, C(ansible_play_hosts_all) (for V(run_members)).
    type: list
    elements: str
  specs:
    description:
      - Every role option with its spec, the roles' C(meta/argument_specs.yml) merged (the
        P(dflash.ops.role_argument_spec#lookup) lookup gives them); for V(variable_types),
        V(variable_names) and V(run_name_and_paths).
    type: dict
  roles:
    description: The roles whose prefixes name role variables (for V(variable_names)).
    type: list
    elements: str
"""

EXAMPLES = r"""
- name: Check every container's inventory entry (one pass for the play).
  ansible.builtin.fail:
    msg: "{{ __problems | join('\n') }}"
  when: __problems | length > 0
  run_once: true
  vars:
    __problems: >-
      {{ groups['training_containers']
         | dflash.ops.preflight('inventory', hostvars=hostvars, groups=groups) }}
"""

RETURN = r"""
_value:
  description:
    - One line per container with problems, its name, a colon and the sentences; each sentence names the
      variable, its value and the fix. Empty when there is none.
  type: list
  elements: str
"""

import json
import posixpath
import re
from collections.abc import Mapping

from ansible.errors import AnsibleFilterError
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

from ansible_collections.dflash.ops.plugins.module_utils.run_pidfile import (
    PLAIN_FILE_NAME,
    is_plain_file_name,
)

# The connections that run a container's tasks through its node's pct.
CONNECTIONS = ("dflash.ops.pct_pipelined", "community.proxmox.proxmox_pct_remote")
# A CT id as Proxmox VE accepts it.
VMID = re.compile(r"^[1-9][0-9]{2,8}$")
# The check families, the filter's `check`.
CHECKS = ("inventory", "run_members", "variable_types", "variable_names", "run_name_and_paths")
# Path options the roles use on the controller, where a relative path means the directory the
# playbook runs from: only the paths in the container and on its node must be absolute.
CONTROLLER_PATHS = frozenset({"dflash_release_source_dir", "dflash_release_build_dir",
                              "dflash_run_export_dir"})


def container_problems(host, hostvars, groups):
    """The inventory entry of training container `host`: its CT id, its node, its connection, and its
    address, which must be its node's."""
    host_vars = hostvars[host]
    vmid = str(host_vars.get("proxmox_vmid", "unset"))
    node = str(host_vars.get("proxmox_node", "unset"))
    nodes = list(groups.get("proxmox_hosts", []))
    connection = host_vars.get("ansible_connection", "unset")
    problems = []
    if not VMID.match(vmid):
        problems.append("a training container needs proxmox_vmid, its numeric CT id (100 to 999999999, as "
                        f"`pct list` on its node shows it); proxmox_vmid is {json.dumps(vmid)}.")
    if node not in nodes:
        problems.append("a training container needs proxmox_node, the inventory name of its Proxmox node (a "
                        f"host of group proxmox_hosts: {', '.join(nodes) or 'none'}); proxmox_node is "
                        f"{json.dumps(node)}. Fix it, or list the node under proxmox_hosts.")
    if connection not in CONNECTIONS:
        problems.append("a training container needs ansible_connection: dflash.ops.pct_pipelined (the "
                        "project's community.proxmox.proxmox_pct_remote with pipelining; that one works too, "
                        "slower): its tasks run through its node's pct; set it in "
                        "group_vars/training_containers.yml. "
                        f"ansible_connection is {json.dumps(connection)}.")
    if node in nodes:
        address, node_address = address_of(host, host_vars), address_of(node, hostvars[node])
        if address != node_address:
            problems.append("a training container is reached through its node, so its ansible_host and "
                            f"ansible_port must be the node's: they are {address}, {node} is at "
                            f"{node_address}.")
    return problems + ["See inventory/production.example/."] if problems else []


def address_of(host, host_vars):
    return f"{host_vars.get('ansible_host', host)}:{host_vars.get('ansible_port', 22)}"


def run_members_problems(host, hostvars, groups, play_hosts):
    """A run across containers that `host` is a member of: declared alike on every member, each member
    reachable at its dflash_run_address, all of them in the play. [] for a run of its own."""
    members = hostvars[host].get("dflash_run_members") or []
    if not members:
        return []
    containers = list(groups.get("training_containers", []))
    names = [member.get("host", "") if isinstance(member, dict) else "" for member in members]
    strangers = [name for name in names if name not in containers]
    known = [hostvars[name] for name in names if name in containers]
    left_out = [name for name in names if name not in play_hosts]
    problems = []
    if host not in names:
        problems.append(f"its dflash_run_members ({', '.join(names)}) does not name it.")
    if strangers:
        problems.append(f"dflash_run_members names {', '.join(strangers)}, not in group training_containers.")
    if any(member.get("dflash_run_members", []) != members for member in known):
        problems.append("the members of a run must declare the same dflash_run_members (in the same order) "
                        "on every member.")
    if not all(member.get("dflash_run_address", "") for member in known):
        problems.append("every member needs dflash_run_address, the address the other members reach it at.")
    if left_out:
        problems.append("a run across containers is deployed, stopped and shown as one: the play (-l) must "
                        f"include all its members ({', '.join(names)}), it leaves out {', '.join(left_out)}.")
    return problems


def plain(value):
    """A variable's value as plain Python data, without Ansible's lazy containers and tags: the argument
    spec validator deep-copies what it is given, and deep-copying those costs far more than the check."""
    if isinstance(value, Mapping):
        return {plain(key): plain(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(plain(item) for item in value)
    if isinstance(value, list):
        return [plain(item) for item in value]
    for kind in (bool, int, float, str):  # bool before int: True is an int too
        if isinstance(value, kind):
            return kind(value) if kind is not str else str.__str__(value)
    return value


def role_variables(host_vars, specs):
    """The role options set for a host (inventory, -e), with their values as plain data."""
    return {name: plain(host_vars[name]) for name in specs if name in host_vars}


def variable_type_problems(host_vars, specs, validator=None):
    """The role variables set for a host that do not have the type or a value their spec allows, in
    the words of Ansible's own argument spec validation (the roles' validation at their start).
    `validator`: an ArgumentSpecValidator of `specs`, built once for many hosts."""
    validator = validator or ArgumentSpecValidator(plain(specs))
    result = validator.validate(role_variables(host_vars, specs), validate_role_argument_spec=True)
    errors = result.error_messages
    if not errors:
        return []
    return [f"{'; '.join(errors)}. Fix the value in the inventory (group_vars, host_vars) or in -e; each "
            "variable's type is in ansible_collections/dflash/ops/roles/<role>/meta/argument_specs.yml."]


def variable_name_problems(host_vars, specs, roles):
    """The variables named like a role's that no role has: a misspelling Ansible would silently ignore."""
    prefix = re.compile(f"^({'|'.join(roles)})_")
    unknown = sorted(name for name in host_vars if prefix.match(name) and name not in specs)
    if not unknown:
        return []
    return [f"{', '.join(unknown)} is not a variable of any role (the {', '.join(roles)} roles have no such "
            "name, so it would change nothing). Fix its name in the inventory or in -e; the variables are "
            "listed in ansible_collections/dflash/ops/roles/<role>/defaults/main.yml."]


def run_name_and_path_problems(host_vars, specs):
    """The run's name, which names files in the container (training_run's rule), and the role variables
    that are paths in the container or on its node, which must be absolute: the tasks there run from no
    fixed directory."""
    problems = []
    run_name = str(host_vars.get("dflash_run_name", "main"))
    if not is_plain_file_name(run_name):
        default = specs.get("dflash_run_name", {}).get("default", "main")
        problems.append(f"dflash_run_name is {json.dumps(run_name)}: the run's name must be "
                        f"{PLAIN_FILE_NAME}, as its pidfile, log and secrets file in the container are named "
                        f"after it. Fix it in the inventory or in -e (the default is {default}).")
    for name, value in role_variables(host_vars, specs).items():
        if name in CONTROLLER_PATHS:
            continue
        relative = [str(path) for path in container_paths(specs[name], value)
                    if not posixpath.isabs(str(path))]
        if relative:
            problems.append(f"{name} is {json.dumps(value)}, and {', '.join(map(json.dumps, relative))} is "
                            "not an absolute path: the roles use it in the container or on its node, where "
                            "tasks run from no fixed directory. Fix it in the inventory (group_vars, "
                            "host_vars) or in -e with a path that starts with /.")
    return problems


def container_paths(spec, value):
    """The paths a role option's value holds, by its spec: one for a path, each element of a list of paths."""
    if spec.get("type") == "path":
        return [value]
    if spec.get("type") == "list" and spec.get("elements") == "path" and isinstance(value, list):
        return value
    return []


class HostCheck:
    """The check families for one training container; its role variables are read once for all of them."""

    def __init__(self, host, hostvars, groups, play_hosts, specs, roles, validator):
        self.host, self.hostvars, self.groups, self.play_hosts = host, hostvars, groups, play_hosts
        self.specs, self.roles, self.validator = specs, roles, validator
        self.host_vars = hostvars[host]
        self._set_vars = None

    @property
    def set_vars(self):
        if self._set_vars is None:
            self._set_vars = role_variables(self.host_vars, self.specs)
        return self._set_vars

    def problems(self, family):
        if family == "inventory":
            return container_problems(self.host, self.hostvars, self.groups)
        if family == "run_members":
            return run_members_problems(self.host, self.hostvars, self.groups, self.play_hosts)
        if family == "variable_types":
            return variable_type_problems(self.set_vars, self.specs, self.validator)
        if family == "variable_names":
            return variable_name_problems(self.host_vars, self.specs, self.roles)
        return run_name_and_path_problems(self.set_vars, self.specs)


def preflight(hosts, check=None, hostvars=None, groups=None, play_hosts=None, specs=None, roles=None):
    """One line per training container of `hosts` with problems, "<host>: <sentences>", from the check
    family `check` (the filter's option) or, without it, every family in the order of CHECKS."""
    if check is not None and check not in CHECKS:
        raise AnsibleFilterError(f"dflash.ops.preflight has no check {check!r} (it has {', '.join(CHECKS)})")
    specs = plain(specs or {})
    validator = ArgumentSpecValidator(specs) if check in (None, "variable_types") else None
    families = [check] if check else CHECKS
    lines = []
    for host in [hosts] if isinstance(hosts, str) else hosts:
        checked = HostCheck(host, hostvars or {}, groups or {}, play_hosts or [], specs, roles or [],
                            validator)
        problems = [problem for family in families for problem in checked.problems(family)]
        if problems:
            lines.append(f"{host}: {' '.join(problems)}")
    return lines


class FilterModule:
    def filters(self):
        return {"preflight": preflight}
