#!/usr/bin/python
# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Ansible modules keep their imports below the documentation blocks.
# ruff: noqa: E402
from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_env_venv
short_description: Ensure the trainer's venv, its dependency path file and the project's wheel, in one call
description:
  - Everything the dflash_env role decides on in the container, in one round trip. Creates the venv
    when it is missing (C(python -m venv --without-pip): no ensurepip, whose run costs seconds of
    CPU in every container; a venv that has pip keeps it), writes the C(.pth) file that adds O(site_packages),
    installs the project's wheel when the venv holds another build, and reports which of
    O(check_imports) the venv does not find.
  - The wheel is pure Python (C(Root-Is-Purelib)), so installing it is unpacking it into the venv's
    site-packages, its console scripts into C(bin/), after removing the files the previous build's
    C(RECORD) lists; no pip and no index. Its source hash is then recorded in C(.dflash-ops-build).
  - The wheel's bytes come in O(wheel_content) (base64), so no separate file transfer is needed.
  - Files are written 0644 and directories 0755 (umask 022), owned by the module's user.
version_added: "0.1.0"
author: dflash-ops contributors
extends_documentation_fragment:
  - ansible.builtin.action_common_attributes
attributes:
  check_mode:
    support: full
    details: Reports what it would change and writes nothing.
  diff_mode:
    support: none
  platform:
    platforms: posix
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
  wheel_content:
    description: The project's wheel, base64.
    type: str
    required: true
  wheel_name:
    description: The wheel's file name (C(name-version-tag.whl)).
    type: str
    required: true
  build:
    description: The wheel's source hash, recorded in the venv once it is installed.
    type: str
    required: true
  check_imports:
    description: Modules the venv must find (looked up, not imported).
    type: list
    elements: str
    default: []
"""

EXAMPLES = r"""
- name: Ensure the trainer's venv with the project's wheel.
  dflash_env_venv:
    venv: /opt/dflash/venv
    site_packages: [/usr/local/lib/python3.11/dist-packages]
    wheel_content: "{{ lookup('ansible.builtin.file', '/tmp/dflash_ops-0.1.0-py3-none-any.whl.b64') }}"
    wheel_name: dflash_ops-0.1.0-py3-none-any.whl
    build: "{{ wheel_sha256 }}"
    check_imports: [torch, dflash]
"""

RETURN = r"""
purelib:
  description: The venv's site-packages directory (null when it does not exist yet, in check mode).
  type: str
  returned: always
actions:
  description: What changed, in order (C(venv), C(pth), C(wheel)).
  type: list
  elements: str
  returned: always
missing:
  description: Modules of O(check_imports) the venv does not find (null in check mode before the venv exists).
  type: list
  elements: str
  returned: always
"""

import base64
import io
import json
import os
import shutil
import zipfile

from ansible.module_utils.basic import AnsibleModule

ARGUMENT_SPEC = {
    "venv": {"type": "path", "required": True},
    "python": {"type": "path", "default": "/usr/bin/python3"},
    "site_packages": {"type": "list", "elements": "path", "default": []},
    "wheel_content": {"type": "str", "required": True, "no_log": True},
    "wheel_name": {"type": "str", "required": True},
    "build": {"type": "str", "required": True},
    "check_imports": {"type": "list", "elements": "str", "default": []},
}
MARKER = ".dflash-ops-build"
PTH = "dflash-deps.pth"
# Run by the venv's python: its site-packages and which modules it does not find.
PROBE = (
    "import importlib.util, json, sys, sysconfig\n"
    "print(json.dumps({'purelib': sysconfig.get_path('purelib'),"
    " 'missing': [m for m in sys.argv[1:] if importlib.util.find_spec(m) is None]}))\n"
)
SCRIPT = "#!{python}\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n"


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


def safe_member(name):
    """A wheel member's path, refused when it would land outside site-packages."""
    parts = name.split("/")
    if name.startswith("/") or ".." in parts or not name or name.endswith("/"):
        return None
    return name


def dist_name(wheel_name):
    """`dflash_ops` from `dflash_ops-0.1.0-py3-none-any.whl`."""
    return wheel_name.split("-", 1)[0]


def installed_records(purelib, name):
    """dist-info directories of earlier installs of the distribution `name`."""
    try:
        entries = os.listdir(purelib)
    except OSError:
        return []
    return sorted(os.path.join(purelib, e) for e in entries
                  if e.endswith(".dist-info") and e.split("-", 1)[0].lower() == name.lower())


def remove_install(purelib, dist_info):
    """Remove the files an earlier install's RECORD lists, its dist-info, and directories left empty."""
    dirs = set()
    for line in read(os.path.join(dist_info, "RECORD")).splitlines():
        rel = line.rsplit(",", 2)[0] if line else ""
        if not rel:
            continue
        path = os.path.normpath(os.path.join(purelib, rel))
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


def console_scripts(entry_points):
    """[(name, module, func)] of a wheel's entry_points.txt [console_scripts] section."""
    out, section = [], None
    for line in entry_points.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif section == "console_scripts" and "=" in line:
            name, target = (s.strip() for s in line.split("=", 1))
            module, _, func = target.partition(":")
            out.append((name, module.strip(), func.strip()))
    return out


def install_wheel(venv, purelib, data, wheel_name):
    """Unpack a pure-Python wheel into `purelib` and write its console scripts, as pip would."""
    name = dist_name(wheel_name)
    for dist_info in installed_records(purelib, name):
        remove_install(purelib, dist_info)
    with zipfile.ZipFile(io.BytesIO(data)) as whl:
        members = [m for m in whl.infolist() if not m.is_dir()]
        bad = [m.filename for m in members if safe_member(m.filename) is None]
        if bad:
            raise ValueError(f"{wheel_name} has paths outside site-packages: {', '.join(bad)}")
        info_dir = next(m.filename.split("/")[0] for m in members
                        if m.filename.split("/")[0].endswith(".dist-info"))
        if "Root-Is-Purelib: true" not in whl.read(f"{info_dir}/WHEEL").decode():
            raise ValueError(f"{wheel_name} is not a pure-Python wheel")
        for member in members:
            dest = os.path.join(purelib, member.filename)
            os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
            with open(dest, "wb") as fh:
                fh.write(whl.read(member))
            os.chmod(dest, 0o644)
        entry_points = whl.read(f"{info_dir}/entry_points.txt").decode() \
            if f"{info_dir}/entry_points.txt" in whl.namelist() else ""
    record = [f"{info_dir}/INSTALLER,,"]
    write(os.path.join(purelib, info_dir, "INSTALLER"), "dflash-ops\n")
    python = os.path.join(venv, "bin", "python")
    for script, module, func in console_scripts(entry_points):
        path = os.path.join(venv, "bin", script)
        write(path, SCRIPT.format(python=python, module=module, func=func), 0o755)
        record.append(f"{os.path.relpath(path, purelib)},,")
    with open(os.path.join(purelib, info_dir, "RECORD"), "a") as fh:
        fh.write("".join(line + "\n" for line in record))


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

    marker = os.path.join(venv, MARKER)
    if read(marker).strip() != p["build"]:
        actions.append("wheel")
        if not check:
            try:
                install_wheel(venv, purelib, base64.b64decode(p["wheel_content"]), p["wheel_name"])
            except (ValueError, KeyError, StopIteration, zipfile.BadZipFile, OSError) as exc:
                module.fail_json(msg=f"cannot install {p['wheel_name']} into {venv}: {exc}", actions=actions)
            write(marker, p["build"] + "\n")

    missing = probe(module, venv, p["check_imports"])["missing"] if p["check_imports"] else []
    module.exit_json(changed=bool(actions), actions=actions, purelib=purelib, missing=missing)


if __name__ == "__main__":
    main()
