#!/usr/bin/python
# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Ansible modules keep their imports below the documentation blocks.
# ruff: noqa: E402
from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_release_tree
short_description: Unpack a release into a staging directory, or make it live, each in one call
description:
  - The container side of the dflash_release role, one round trip per step.
  - V(staged) reads the C(current) symlink; when it points elsewhere and the release directory does
    not exist yet, unpacks the archive (O(content), base64 tar.gz, so no separate file transfer)
    into C(releases/.staging-<id>) for the role to validate. A release that exists already is
    checked instead: a file or directory in it writable by group or others, or not owned by the
    module's user, fails the task (a tampered release is never made live).
  - V(live) moves a validated staging directory into place, points C(previous) at the release that
    was live, switches C(current) atomically (a new symlink renamed over the old one), and keeps the
    newest O(keep) releases (the live and the previous one always), removing staging leftovers.
  - Unpacked files are 0644 (0755 when executable in the archive, as C(run.sh)), directories 0755,
    all owned by the module's user; links, devices and paths outside the directory are refused.
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
  state:
    description: V(staged) the release exists or is unpacked for validation; V(live) it is the current one.
    type: str
    choices: [staged, live]
    required: true
  root:
    description: Base directory (C(releases/), C(current), C(previous)).
    type: path
    required: true
  release:
    description: The release's directory, C(<root>/releases/<id>).
    type: path
    required: true
  content:
    description: The release archive (tar.gz), base64. Required with V(staged).
    type: str
  staging:
    description: With V(live), a validated staging directory to move into place first.
    type: path
  keep:
    description: With V(live), releases to keep (the live and the previous one always); V(0) removes none.
    type: int
    default: 0
"""

EXAMPLES = r"""
- name: Ensure the release is in the container.
  dflash_release_tree:
    state: staged
    root: /opt/dflash
    release: /opt/dflash/releases/0123456789ab
    content: "{{ lookup('ansible.builtin.file', '/tmp/0123456789ab.tar.gz.b64') }}"
  register: stage

- name: Ensure the release is live.
  dflash_release_tree:
    state: live
    root: /opt/dflash
    release: /opt/dflash/releases/0123456789ab
    staging: "{{ stage.staging }}"
    keep: 3
"""

RETURN = r"""
current:
  description: Where C(current) pointed before the call (null when it did not exist).
  type: str
  returned: always
live:
  description: Whether C(current) points at the release after the call.
  type: bool
  returned: always
staging:
  description: With V(staged), the directory the new release was unpacked into, to validate (null when
    the release is live or exists already).
  type: str
  returned: always
removed:
  description: With V(live), the release and staging directories removed.
  type: list
  elements: str
  returned: always
"""

import base64
import io
import os
import shutil
import stat
import tarfile

from ansible.module_utils.basic import AnsibleModule

ARGUMENT_SPEC = {
    "state": {"type": "str", "choices": ["staged", "live"], "required": True},
    "root": {"type": "path", "required": True},
    "release": {"type": "path", "required": True},
    "content": {"type": "str", "no_log": True},
    "staging": {"type": "path"},
    "keep": {"type": "int", "default": 0},
}
STAGING_PREFIX = ".staging-"


def link_target(path):
    return os.readlink(path) if os.path.islink(path) else None


def staging_dir(release):
    return os.path.join(os.path.dirname(release), STAGING_PREFIX + os.path.basename(release))


def unsafe_entries(top):
    """Entries under `top` writable by group or others or owned by another user, as 'path (mode, uid)'."""
    uid, found = os.getuid(), []
    for root, _dirs, files in os.walk(top):
        for path in [root] + [os.path.join(root, f) for f in files]:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_uid != uid:
                found.append(f"{path} (mode {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid})")
    return found


def unpack(data, dest):
    """Unpack a tar.gz of regular files into a new `dest`: no paths outside it, no links or devices,
    files 0644 (0755 when executable in the archive), directories 0755."""
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest, mode=0o755)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if member.name.startswith("/") or ".." in parts or not (member.isfile() or member.isdir()):
                raise ValueError(f"the archive holds {member.name!r}, which is not a plain path inside it")
            path = os.path.join(dest, member.name)
            if member.isdir():
                os.makedirs(path, mode=0o755, exist_ok=True)
                continue
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            with open(path, "wb") as fh:
                shutil.copyfileobj(tar.extractfile(member), fh)
            os.chmod(path, 0o755 if member.mode & stat.S_IXUSR else 0o644)


def set_link(path, target):
    """Point the symlink `path` at `target` atomically (a new link renamed over the old one)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, path)


def doomed(releases_dir, keep, protected):
    """Release directories beyond the newest `keep` (never `protected`), and every staging leftover."""
    entries = [os.path.join(releases_dir, e) for e in os.listdir(releases_dir)]
    entries = [e for e in entries if os.path.isdir(e) and not os.path.islink(e)]
    staging = [e for e in entries if os.path.basename(e).startswith(STAGING_PREFIX)]
    kept = sorted((e for e in entries if e not in staging), key=os.path.getmtime, reverse=True)
    old = [e for e in kept[keep:] if e not in protected] if keep > 0 else []
    return sorted(old) + sorted(staging)


def staged(module, p, current):
    release = p["release"]
    if current == release or os.path.isfile(os.path.join(release, "REVISION")):
        bad = unsafe_entries(release)
        if bad:
            module.fail_json(
                msg=f"Release {release} is writable by other users or not owned by uid {os.getuid()}: "
                    f"{', '.join(bad[:5])}. Remove the directory (rm -r {release}) and deploy again "
                    f"to unpack it afresh.", current=current, unsafe=bad)
        module.exit_json(changed=False, current=current, live=current == release, staging=None, removed=[])
    if not p["content"]:
        module.fail_json(msg="state=staged needs content (the release archive, base64).")
    dest = staging_dir(release)
    if not module.check_mode:
        os.makedirs(os.path.dirname(release), mode=0o755, exist_ok=True)
        try:
            unpack(base64.b64decode(p["content"]), dest)
        except (tarfile.TarError, OSError, ValueError) as exc:
            shutil.rmtree(dest, ignore_errors=True)
            module.fail_json(msg=f"cannot unpack the release into {dest}: {exc}", current=current)
    module.exit_json(changed=True, current=current, live=False, staging=dest, removed=[])


def live(module, p, current):
    release, root, check = p["release"], p["root"], module.check_mode
    changed = False
    if p["staging"] and os.path.isdir(p["staging"]):
        changed = True
        if not check:
            if os.path.isfile(os.path.join(release, "REVISION")):
                shutil.rmtree(p["staging"])
            else:
                shutil.rmtree(release, ignore_errors=True)
                os.rename(p["staging"], release)
    elif not check and not os.path.isdir(release):
        module.fail_json(msg=f"Release {release} does not exist; nothing was switched.", current=current)
    if current != release:
        changed = True
        if not check:
            if current:
                set_link(os.path.join(root, "previous"), current)
            set_link(os.path.join(root, "current"), release)
    protected = {release, current, link_target(os.path.join(root, "previous"))}
    removed = doomed(os.path.join(root, "releases"), p["keep"], protected) \
        if os.path.isdir(os.path.join(root, "releases")) else []
    if removed:
        changed = True
        if not check:
            for path in removed:
                shutil.rmtree(path, ignore_errors=True)
    module.exit_json(changed=changed, current=current, live=True, staging=None, removed=removed)


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    os.umask(0o022)
    p = module.params
    current = link_target(os.path.join(p["root"], "current"))
    if p["state"] == "staged":
        staged(module, p, current)
    live(module, p, current)


if __name__ == "__main__":
    main()
