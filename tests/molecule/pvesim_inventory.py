#!/usr/bin/env python3
"""Ansible inventory script for the molecule scenarios: the hosts.yml that create.yml's pvesim wrote.

Molecule links it into every scenario's inventory (provisioner.inventory.links.hosts). Before
create.yml has run (or after destroy.yml) it reports no hosts.
"""

import json
import os
import sys
from pathlib import Path

import yaml


def groups_to_script(node, name, out):
    """Flatten a YAML inventory group into the script format (groups with hosts, children, hostvars)."""
    group = out.setdefault(name, {"hosts": [], "children": []})
    for host, hostvars in (node.get("hosts") or {}).items():
        group["hosts"].append(host)
        out["_meta"]["hostvars"].setdefault(host, {}).update(hostvars or {})
    for child, sub in (node.get("children") or {}).items():
        group["children"].append(child)
        groups_to_script(sub or {}, child, out)


def main():
    if "--host" in sys.argv:
        print("{}")
        return
    out = {"_meta": {"hostvars": {}}}
    ephemeral = os.environ.get("MOLECULE_EPHEMERAL_DIRECTORY")
    path = Path(ephemeral) / "pvesim" / "hosts.yml" if ephemeral else None
    if path and path.is_file():
        groups_to_script(yaml.safe_load(path.read_text())["all"], "all", out)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
