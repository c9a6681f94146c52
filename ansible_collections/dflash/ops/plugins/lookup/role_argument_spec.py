# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Ansible plugins keep their imports below the documentation blocks.
# ruff: noqa: E402
from __future__ import annotations

DOCUMENTATION = r"""
---
name: role_argument_spec
author: dflash-ops contributors (@dflash-ops)
version_added: "0.3.0"
short_description: The options of the dflash.ops roles, as their meta/argument_specs.yml types them
description:
  - Reads the C(meta/argument_specs.yml) of each named role of this collection and returns the options
    of one entry point, so that a playbook can check every role's variables before any role runs.
  - The roles are found next to this plugin, in whichever copy of the collection Ansible loaded it from
    (the repository's C(ansible_collections/), or a collection installed with C(ansible-galaxy)), never
    relative to the playbook.
options:
  _terms:
    description: Names of roles of the dflash.ops collection, without the collection's prefix.
    required: true
    type: list
    elements: str
  entry_point:
    description: The entry point of each role whose options are returned.
    type: str
    default: main
"""

EXAMPLES = r"""
- name: Check the variables of two roles at once.
  ansible.builtin.validate_argument_spec:
    argument_spec: "{{ query('dflash.ops.role_argument_spec', 'dflash_env', 'dflash_run') | combine }}"
"""

RETURN = r"""
_raw:
  description: One dict a role, in the order named, from option name to its spec.
  type: list
  elements: dict
"""

import os

from ansible.errors import AnsibleLookupError
from ansible.plugins.lookup import LookupBase

# This file is <collection>/plugins/lookup/role_argument_spec.py.
COLLECTION_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROLES_DIR = os.path.join(COLLECTION_DIR, "roles")


class LookupModule(LookupBase):
    def run(self, terms, variables=None, **kwargs):
        self.set_options(var_options=variables, direct=kwargs)
        entry_point = self.get_option("entry_point")
        return [self.options_of(role, entry_point) for role in terms]

    def options_of(self, role, entry_point):
        path = os.path.join(ROLES_DIR, role, "meta", "argument_specs.yml")
        if not os.path.isfile(path):
            roles = sorted(name for name in os.listdir(ROLES_DIR) if not name.startswith("."))
            raise AnsibleLookupError(f"dflash.ops has no role {role!r} with an argument spec ({path} is "
                                     f"missing); its roles: {', '.join(roles)}")
        entry_points = (self._loader.load_from_file(path) or {}).get("argument_specs") or {}
        if entry_point not in entry_points:
            raise AnsibleLookupError(f"role dflash.ops.{role} has no entry point {entry_point!r} in {path} "
                                     f"(it has {', '.join(entry_points) or 'none'})")
        return entry_points[entry_point].get("options") or {}
