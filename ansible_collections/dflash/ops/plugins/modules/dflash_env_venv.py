#!/usr/bin/python
# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Ansible modules keep their imports below the documentation blocks.
# ruff: noqa: E402
from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_env_venv
short_description: Ensure the trainer's venv and the path file to its dependencies, in one call
description:
  - Everything the dflash_env role decides on in the container, in one round trip. Creates the venv
    when it is missing (C(python -m venv --without-pip); no ensurepip, whose run costs seconds of
    CPU in every container; a venv that has pip keeps it), writes the C(.pth) file that adds O(site_packages),
    and reports which of O(check_imports) the venv does not find.
  - The venv holds the trainer's dependencies only. The trainer's code comes from the release
    (C(run.sh) puts the release first on C(PYTHONPATH)), so it reaches the container once. A build of
    the project that an earlier version of this module installed into the venv (C(dflash_ops-*.dist-info))
    is removed, file by file as its C(RECORD) lists them.
  - Files are written 0644 and directories 0755 (umask 022), owned by the module's user.
version_added: "0.3.0"
author: dflash-ops contributors (@dflash-ops)
extends_documentation_fragment:
  - dflash.ops.attributes
attributes:
  check_mode:
    support: full
    details: Reports what it would change and writes nothing.
options:
  venv:
    description: The venv's directory.
    type: path
    required: true
  python:
    description: Interpreter that creates the venv.
    type: path
    default: /usr/bin/python3
  site_packages:
    description: Directories the C(.pth) file adds to the venv's path (one a line).
    type: list
    elements: path
    default: []
  check_imports:
    description: Modules the venv must find (looked up, not imported).
    type: list
    elements: str
    default: []
  missing_hint:
    description:
      - When set, a venv that does not find some of O(check_imports) fails the task, with a message that
        names them and ends with this hint (what to set so that it finds them). Empty, they are only
        reported in RV(missing).
    type: str
    default: ""
"""

EXAMPLES = r"""
- name: Ensure the trainer's venv, with the node image's torch on its path.
  dflash.ops.dflash_env_venv:
    venv: /opt/dflash/venv
    site_packages: [/usr/local/lib/python3.11/dist-packages]
    check_imports: [torch, transformers]
"""

RETURN = r"""
purelib:
  description: The venv's site-packages directory (null when it does not exist yet, in check mode).
  type: str
  returned: always
actions:
  description: What changed, in order (C(venv), C(pth), C(old-build)).
  type: list
  elements: str
  returned: always
missing:
  description: Modules of O(check_imports) the venv does not find (null in check mode before the venv exists).
  type: list
  elements: str
  returned: always
"""

import json
import os
import shutil

from ansible.module_utils.basic import AnsibleModule

ARGUMENT_SPEC = {
    "venv": {"type": "path", "required": True},
    "python": {"type": "path", "default": "/usr/bin/python3"},
    "site_packages": {"type": "list", "elements": "path", "default": []},
    "check_imports": {"type": "list", "elements": "str", "default": []},
    "missing_hint": {"type": "str", "default": ""},
}
# What an earlier version installed: the project's wheel and the marker of its build.
OLD_DIST = "dflash_ops"
OLD_MARKER = ".dflash-ops-build"
PTH = "dflash-deps.pth"
# Run by the venv's python: its site-packages and which modules it does not find.
PROBE = (
    "import importlib.util, json, sys, sysconfig\n"
    "print(json.dumps({'purelib': sysconfig.get_path('purelib'),"
    " 'missing': [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]}))\n"
)


def read(path):
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return ""


def write(path, text, mode=0o644):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def installed_records(purelib, name):
    """dist-info directories of installs of the distribution `name`."""
    try:
        entries = os.listdir(purelib)
    except OSError:
        return []
    return sorted(os.path.join(purelib, e) for e in entries
                  if e.endswith(".dist-info") and e.split("-", 1)[0].lower() == name.lower())


def remove_install(venv, purelib, dist_info):
    """Remove the files an install's RECORD lists (inside the venv only), its dist-info, and directories
    left empty."""
    venv_root, purelib = os.path.realpath(venv), os.path.realpath(purelib)
    dirs = set()
    for line in read(os.path.join(dist_info, "RECORD")).splitlines():
        rel = line.rsplit(",", 2)[0] if line else ""
        if not rel:
            continue
        path = os.path.realpath(os.path.join(purelib, rel))
        if not path.startswith(venv_root + os.sep):
            continue
        if os.path.isfile(path) or os.path.islink(path):
            os.unlink(path)
        dirs.add(os.path.dirname(path))
    shutil.rmtree(dist_info, ignore_errors=True)
    for path in sorted(dirs, key=len, reverse=True):
        while path.startswith(purelib + os.sep):
            try:
                os.rmdir(path)
            except OSError:
                break
            path = os.path.dirname(path)


def probe(module, venv, imports):
    python = os.path.join(venv, "bin", "python")
    if not os.access(python, os.X_OK):
        return None
    rc, out, err = module.run_command([python, "-c", PROBE, *imports])
    if rc != 0:
        module.fail_json(msg=f"{venv} is not a working venv: {(err or out).strip()}")
    return json.loads(out)


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    venv, check = p["venv"], module.check_mode
    os.umask(0o022)
    actions = []

    state = probe(module, venv, [])
    if state is None:
        actions.append("venv")
        if check:
            module.exit_json(changed=True, actions=actions, purelib=None, missing=None)
        rc, out, err = module.run_command([p["python"], "-m", "venv", "--without-pip", venv])
        if rc != 0:
            module.fail_json(msg=f"cannot create the venv {venv} with {p['python']}: {(err or out).strip()}",
                             actions=actions)
        state = probe(module, venv, [])
    purelib = state["purelib"]
    pth = "".join(f"{path}\n" for path in p["site_packages"])
    if read(os.path.join(purelib, PTH)) != pth:
        actions.append("pth")
        if not check:
            write(os.path.join(purelib, PTH), pth)

    old_builds = installed_records(purelib, OLD_DIST)
    if old_builds:
        actions.append("old-build")
        if not check:
            for dist_info in old_builds:
                remove_install(venv, purelib, dist_info)
            if os.path.exists(os.path.join(venv, OLD_MARKER)):
                os.unlink(os.path.join(venv, OLD_MARKER))

    missing = probe(module, venv, p["check_imports"])["missing"] if p["check_imports"] else []
    result = dict(changed=bool(actions), actions=actions, purelib=purelib, missing=missing)
    if missing and p["missing_hint"]:
        module.fail_json(msg=f"The venv {venv} does not find {', '.join(missing)}. {p['missing_hint']}",
                         **result)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
