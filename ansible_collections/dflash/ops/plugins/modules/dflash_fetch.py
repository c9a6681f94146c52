#!/usr/bin/python
# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Ansible modules keep their imports below the documentation blocks.
# ruff: noqa: E402
from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_fetch
short_description: Copy a run's files (metrics, TensorBoard events) to the controller, following no link
description:
  - In the container, reads each of O(paths) (a file, or a directory and every file under it) of the run's
    output directory O(src) as root, and only when it is a regular file of root's or of O(owner)'s, not
    writable by other users, reached from C(/) one name at a time without a symbolic link on the way (the
    file opened with C(O_NOFOLLOW) inside its directory's descriptor). A link (to C(/etc/shadow), say),
    another user's file or directory, or a device fails the task naming it, and nothing of that container
    is copied. A path that does not exist is skipped.
  - On the controller (the action plugin of the same name), O(dest) is made with mode 0700 when missing,
    and refused when it is another user's, a link, or writable by its group or others; each file is
    written 0600 (its directories 0700) through a temporary file renamed over the name, and only when
    its sha256 differs from the copy already there.
version_added: "0.5.0"
author: dflash-ops contributors (@dflash-ops)
extends_documentation_fragment:
  - dflash.ops.attributes
attributes:
  action:
    description: Runs an action plugin on the controller around the module.
    support: full
    details: The controller's directory and the files written there are the action plugin's.
  check_mode:
    support: full
    details: Reads only in the container; the controller's copy is written in check mode too (it changes
      nothing on the fleet), unless the task sets C(check_mode) itself.
options:
  src:
    description: The run's output directory in the container.
    type: path
    required: true
  paths:
    description:
      - Each path to copy, relative to O(src), and the path relative to O(dest) it lands at; a
        directory's files land under the directory it names, at their own relative paths.
    type: dict
    required: true
  owner:
    description: The container user the run runs as (C(dflash_run_user)), whose files are trusted as root's.
    type: str
    default: ""
  dest:
    description: The directory on the controller (made 0700 when missing).
    type: path
    required: true
  max_bytes:
    description: The largest file taken; a larger one fails the task.
    type: int
    default: 268435456
  have:
    description:
      - Internal (the action plugin's) - the sha256 of the controller's copies, which are not sent again.
    type: dict
    default: {}
"""

EXAMPLES = r"""
- name: Ensure the run's metrics and TensorBoard events are on the controller.
  dflash.ops.dflash_fetch:
    src: /var/lib/dflash/runs/main
    paths:
      metrics.jsonl: "{{ inventory_hostname }}.metrics.jsonl"
      tensorboard: "{{ inventory_hostname }}"
    owner: dflash
    dest: /srv/metrics
"""

RETURN = r"""
files:
  description: Each file found, by its path relative to O(src), with its sha256 and size.
  type: dict
  returned: success
fetched:
  description: The paths on the controller written now (action plugin).
  type: list
  elements: str
  returned: success
"""

import base64
import pwd

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.dflash.ops.plugins.module_utils.safe_fetch import read_run_files, sha256_bytes
from ansible_collections.dflash.ops.plugins.module_utils.safe_paths import UnsafePath

ARGUMENT_SPEC = {
    "src": {"type": "path", "required": True},
    "paths": {"type": "dict", "required": True},
    "owner": {"type": "str", "default": ""},
    "dest": {"type": "path", "required": True},
    "max_bytes": {"type": "int", "default": 1 << 28},
    "have": {"type": "dict", "default": {}},
}


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    uid = None
    if p["owner"]:
        try:
            uid = pwd.getpwnam(p["owner"]).pw_uid
        except KeyError:
            module.fail_json(msg=f"The run's user {p['owner']} does not exist in the container; nothing was "
                                 "copied.")
    try:
        found = read_run_files(p["src"], list(p["paths"]), owner=uid, max_bytes=p["max_bytes"])
    except FileNotFoundError:
        found = {}
    except UnsafePath as exc:
        module.fail_json(msg=f"{exc}: it is not taken, and nothing of {p['src']} was copied to the "
                             "controller (whoever can write in the run's output directory made it so: "
                             "check it).",
                         path=exc.path)
    files = {}
    for relative, data in found.items():
        digest = sha256_bytes(data)
        files[relative] = {"sha256": digest, "size": len(data)}
        if p["have"].get(relative) != digest:
            files[relative]["content"] = base64.b64encode(data).decode("ascii")
    module.exit_json(changed=False, files=files)


if __name__ == "__main__":
    main()
