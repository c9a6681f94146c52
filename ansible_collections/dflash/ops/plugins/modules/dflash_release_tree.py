#!/usr/bin/python
# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Ansible modules keep their imports below the documentation blocks.
# ruff: noqa: E402
from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_release_tree
short_description: Make a release live in one call (unpacked, checked and validated first)
description:
  - The container side of the dflash_release role, one round trip per deploy or rollback.
  - A release that does not exist yet (no C(REVISION)) is unpacked from O(content) (base64 tar.gz,
    so no separate file transfer) into C(releases/.staging-<id>). A release that exists already is
    checked instead; a file or directory in it writable by group or others, or not owned by the
    module's user, fails the task (a tampered release is never made live).
  - Unless it is the live one already, the release (the staging directory for a new one) is then
    validated with O(validate_argv), before anything is moved or switched. A validation that exits
    non-zero does not fail the task; it returns RV(validated=false) and the command's output, switches
    nothing and leaves the staging directory for inspection (the next switch removes it), so the
    caller can say what to fix.
  - A validated release is moved into place, C(previous) points at the release that was live,
    C(current) is switched atomically (a new symlink renamed over the old one), and the newest O(keep)
    releases are kept (the live and the previous one always), removing staging leftovers.
  - The live release is left as it is (checked only), so an unchanged deploy changes nothing.
  - Its action plugin runs on the controller first. With O(build) it packs the release there (the
    trainer's code and this container's files rendered from templates, in a cache of archives shared by
    the deploy's processes, so that containers with the same files share one archive) and passes it as
    O(content),
    with O(release) named after its content hash. After the call it fails a release that does not
    validate with the trainer's words and the variable to fix (O(fix_variables)).
  - Unpacked files are 0644 (0755 when executable in the archive, as C(run.sh)), directories 0755,
    all owned by the module's user; links, devices and paths outside the directory are refused.
version_added: "0.3.0"
author: dflash-ops contributors (@dflash-ops)
extends_documentation_fragment:
  - dflash.ops.attributes
attributes:
  check_mode:
    support: full
    details: Reports what it would change; writes nothing and runs no validation.
  diff_mode:
    support: full
    details: A switch shows each rendered file (C(config.yaml), C(run.sh)) of the live release beside the
      new one's.
options:
  state:
    description:
      - V(live) makes O(release) the live release.
      - V(previous) makes the release C(previous) points at live again (a rollback; C(previous) then
        points at the one that was live). Fails when C(current) or C(previous) is missing or both name
        one release.
    type: str
    choices: [live, previous]
    default: live
  root:
    description: Base directory (C(releases/), C(current), C(previous)).
    type: path
    required: true
  release:
    description:
      - The release's directory, C(<root>/releases/<id>). Required with V(live) unless O(build) names it;
        not given with V(previous).
    type: path
  content:
    description: The release archive (tar.gz), base64, unpacked when the release does not exist yet.
    type: str
  build:
    description:
      - The release to pack on the controller (by the action plugin) in place of O(release) and O(content)
        - C(code_dir) the trainer's package, C(dest_dir) the controller's archive cache, C(exclude) files of
        the package that never ship, C(revision) the source revision recorded in C(REVISION), C(templates)
        {name in the release - template} of the files rendered with the task's variables (the role's
        C(templates/) directory), and optionally C(environment), the variables C(run.sh) exports in the
        clear (C(dflash_release_environment)) - the deploy refuses a name that looks like a secret's
        (TOKEN, KEY, SECRET, PASSWORD), which belongs in C(dflash_run_secret_environment), unless
        C(environment_allowed) (C(dflash_release_environment_allowed)) names it.
    type: dict
  fix_variables:
    description:
      - For the failure of a release that does not validate - the inventory variable that sets each config
        key (V(pipeline.target_gpus) - V(dflash_release_target_gpus)); a key without one is named as a key
        of C(dflash_release_settings). Used on the controller only.
    type: dict
    default: {}
  validate_argv:
    description:
      - The command that validates a release before it goes live, as an argument list; every C(%s) in
        it is replaced by the directory validated (the staging directory of a new release). Exit 0
        means valid. Without it nothing is validated.
    type: list
    elements: str
  validate_environment:
    description: Environment variables of the validation command; C(%s) in a value as in O(validate_argv).
    type: dict
    default: {}
  keep:
    description: Releases to keep after a switch (the live and the previous one always); V(0) removes none.
    type: int
    default: 0
"""

EXAMPLES = r"""
- name: Ensure the release is live (packed on the controller, unpacked and validated first when it is new).
  dflash.ops.dflash_release_tree:
    root: /opt/dflash
    build:
      code_dir: /srv/dflash-ops/dflash_ops
      dest_dir: /srv/dflash-ops/.cache/releases
      revision: v1.2.0
      templates:
        config.yaml: config.yaml.j2
        run.sh: run.sh.j2
    validate_argv: [/opt/dflash/venv/bin/python, -m, dflash_ops.config, validate, --json, "%s/config.yaml"]
    validate_environment:
      PYTHONPATH: "%s"
    fix_variables:
      data.path: dflash_release_data_path
    keep: 3
  register: release

- name: Ensure a release packed elsewhere is live.
  dflash.ops.dflash_release_tree:
    root: /opt/dflash
    release: /opt/dflash/releases/0123456789ab
    content: "{{ lookup('ansible.builtin.file', '/tmp/0123456789ab.tar.gz.b64') }}"

- name: Go back to the previous release (validated again first).
  dflash.ops.dflash_release_tree:
    state: previous
    root: /opt/dflash
    validate_argv: [/opt/dflash/venv/bin/python, -m, dflash_ops.config, validate, "%s/config.yaml"]
    validate_environment:
      PYTHONPATH: "%s"
"""

RETURN = r"""
current:
  description: Where C(current) pointed before the call (null when it did not exist).
  type: str
  returned: always
release:
  description: The release made live or left live (with V(previous), the one C(previous) named).
  type: str
  returned: always
live:
  description: Whether C(current) points at the release after the call (in check mode, would point).
  type: bool
  returned: always
validated:
  description: V(true) the validation passed, V(false) it failed (nothing was switched), null it did not
    run (the release was live already, no O(validate_argv), or check mode).
  type: bool
  returned: always
validation:
  description: The validation command's result (null when it did not run).
  type: dict
  returned: always
  contains:
    dir:
      description: The directory validated (the staging directory of a new release).
      type: str
    cmd:
      description: The command run.
      type: list
      elements: str
    rc:
      description: Its exit status.
      type: int
    stdout:
      description: Its standard output.
      type: str
    stderr:
      description: Its standard error.
      type: str
    msg:
      description: Why it could not be run (only then).
      type: str
staging:
  description: The staging directory a new release was unpacked into (moved into place once validated,
    left for inspection when not); null when the release existed.
  type: str
  returned: always
removed:
  description: The old release and staging directories removed after the switch.
  type: list
  elements: str
  returned: always
built:
  description: The release packed on the controller - C(id), C(archive) and C(archive_b64) (its paths there),
    C(code_sha256), C(files) {path in the release - sha256}.
  type: dict
  returned: with O(build)
"""

import base64
import io
import os
import shutil
import stat
import tarfile

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.dflash.ops.plugins.module_utils.safe_paths import path_problem, refusal

ARGUMENT_SPEC = {
    "state": {"type": "str", "choices": ["live", "previous"], "default": "live"},
    "root": {"type": "path", "required": True},
    "release": {"type": "path"},
    "content": {"type": "str", "no_log": True},
    "validate_argv": {"type": "list", "elements": "str"},
    "validate_environment": {"type": "dict", "default": {}},
    "keep": {"type": "int", "default": 0},
    # Consumed on the controller by the action plugin (documented above); the module never gets them.
    "build": {"type": "dict"},
    "fix_variables": {"type": "dict", "default": {}},
}
STAGING_PREFIX = ".staging-"
# The files a deploy renders for each container: what --diff shows of a release change.
RENDERED = ("config.yaml", "run.sh")


def link_target(path):
    return os.readlink(path) if os.path.islink(path) else None


def staging_dir(release):
    return os.path.join(os.path.dirname(release), STAGING_PREFIX + os.path.basename(release))


def unsafe_entries(top):
    """Entries under `top` (itself included) writable by group or others, owned by another user or that are
    symbolic links, as 'path (mode, uid)' or 'path (a symbolic link to ...)'."""
    uid, found = os.getuid(), []
    for root, dirs, files in os.walk(top):
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]  # os.walk does not enter them
        for path in [root] + [os.path.join(root, f) for f in files + links]:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):  # an unpacked release has none (unpack refuses links)
                found.append(f"{path} (a symbolic link to {os.readlink(path)})")
            elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or st.st_uid != uid:
                found.append(f"{path} (mode {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid})")
    return found


def unpacked_size(data, block=4096):
    """Bytes (whole blocks of `block`) and inodes the archive `data` takes once unpacked."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
    blocks = sum(-(-m.size // block) if m.isfile() else 1 for m in members) + 1
    return blocks * block, len(members) + 1


def room_problem(data, directory):
    """Why the filesystem of `directory` cannot hold the archive unpacked, or None (checked before a byte
    is written, so a full disk fails with what it needs rather than half-way through the unpack)."""
    fs = os.statvfs(directory)
    needed, inodes = unpacked_size(data, fs.f_frsize or 4096)
    free = fs.f_bavail * fs.f_frsize
    if needed > free:
        return (f"needs {needed / 2**20:.1f} MiB and the filesystem of {directory} has "
                f"{free / 2**20:.1f} MiB free")
    if fs.f_files and inodes > fs.f_favail:
        return f"needs {inodes} inodes and the filesystem of {directory} has {fs.f_favail} free"
    return None


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


def validation_command(argv, environment, directory):
    """The validation's argument list and environment for `directory` (every %s replaced by it)."""
    return ([arg.replace("%s", directory) for arg in argv],
            {name: str(value).replace("%s", directory) for name, value in environment.items()})


def validate(module, directory):
    """Run the validation command on `directory`: {dir, cmd, rc, stdout, stderr} (and msg when it
    could not be started)."""
    cmd, env = validation_command(module.params["validate_argv"], module.params["validate_environment"],
                                  directory)
    try:
        rc, out, err = module.run_command(cmd, environ_update=env, expand_user_and_vars=False,
                                          handle_exceptions=False)
    except OSError as exc:  # as the command module reports it: the errno as rc, the error as msg
        return {"dir": directory, "cmd": cmd, "rc": exc.errno or 1, "stdout": "", "stderr": "",
                "msg": str(exc)}
    return {"dir": directory, "cmd": cmd, "rc": rc, "stdout": out, "stderr": err}


def rendered_text(release, name, archive=None):
    """A rendered file of a release, from its archive when given (a release not unpacked yet), else from
    its directory; '' when it has none (no release live yet)."""
    if archive is not None:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            try:
                member = tar.extractfile(name)
            except KeyError:
                return ""
            return member.read().decode("utf-8", "replace") if member else ""
    if not release or os.path.islink(os.path.join(release, name)):
        return ""
    try:
        with open(os.path.join(release, name), encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return ""


def rendered_diff(current, release, archive=None):
    """--diff of a switch: each rendered file that differs between the live release and the new one."""
    diffs = []
    for name in RENDERED:
        before, after = rendered_text(current, name), rendered_text(release, name, archive)
        if before != after:
            diffs.append({"before": before, "after": after, "before_header": f"{current or '(none)'}/{name}",
                          "after_header": f"{release}/{name}"})
    return diffs


def previous_release(module, root, current):
    """The release `previous` points at, when there is one to go back to."""
    previous = link_target(os.path.join(root, "previous"))
    if not current:
        why = f"{root}/current does not exist"
    elif not previous:
        why = f"{root}/previous does not exist"
    else:
        why = f"{root}/previous points at the live release" if previous == current else None
    if why:
        module.fail_json(msg=f"There is no previous release to roll back to ({why}).", current=current)
    return previous


def refuse_unsafe(module, release, current):
    """Fail when another user could have changed the release: it never goes (or stays) live then."""
    bad = unsafe_entries(release)
    if bad:
        module.fail_json(
            msg=f"Release {release} is writable by other users, not owned by uid {os.getuid()} or holds a "
                f"symbolic link: "
                f"{', '.join(bad[:5])}. Remove the directory (rm -r {release}) and deploy again "
                f"to unpack it afresh.", current=current, unsafe=bad)


def refuse_unsafe_directories(module, root, release, current):
    """Fail when the release root, releases/ or the release's staging directory is a symbolic link or a
    directory another user could change: an unpack or a switch would then write where they chose."""
    releases = os.path.dirname(release)
    for what, path in (("release root directory", root), ("releases directory", releases),
                       ("release directory", release), ("staging directory", staging_dir(release))):
        problem = path_problem(path, directory=True)
        if problem:
            module.fail_json(msg=refusal(what, path, problem, "nothing was unpacked or switched"),
                             current=current)


def make_live(module, root, release, current):
    """Ensure `release` (existing, or unpacked into staging and validated first) is live; the result."""
    p, check = module.params, module.check_mode
    refuse_unsafe_directories(module, root, release, current)
    result = {"current": current, "release": release, "live": True, "validated": None, "validation": None,
              "staging": None, "removed": []}
    exists = os.path.isfile(os.path.join(release, "REVISION"))
    if exists or current == release:
        refuse_unsafe(module, release, current)
    if current == release:
        return False, result
    candidate = release
    if not exists:
        if not p["content"]:
            module.fail_json(msg=f"Release {release} does not exist and no content (the release archive) "
                                 f"was given; nothing was switched.", current=current)
        candidate = result["staging"] = staging_dir(release)
        if not check:
            os.makedirs(os.path.dirname(release), mode=0o755, exist_ok=True)
            shutil.rmtree(candidate, ignore_errors=True)  # a leftover's space counts as free
            try:
                data = base64.b64decode(p["content"])
                no_room = room_problem(data, os.path.dirname(release))
                if no_room:
                    module.fail_json(msg=f"cannot unpack the release into {candidate}: it {no_room} (No "
                                         f"space left on device); nothing was unpacked or switched. Free "
                                         f"space there (fewer releases kept: dflash_release_keep) or give "
                                         f"it a larger disk.", current=current)
                unpack(data, candidate)
            except (tarfile.TarError, OSError, ValueError) as exc:
                shutil.rmtree(candidate, ignore_errors=True)
                module.fail_json(msg=f"cannot unpack the release into {candidate}: {exc}; nothing was "
                                     f"switched (the staging directory was removed).", current=current)
    if p["validate_argv"] and not check:
        result["validation"] = validate(module, candidate)
        result["validated"] = result["validation"]["rc"] == 0
        if not result["validated"]:
            # Nothing moves or switches; a new release's staging directory stays for inspection.
            result["live"] = False
            return not exists, result
    if not check:
        if candidate != release:
            shutil.rmtree(release, ignore_errors=True)  # an incomplete leftover (no REVISION)
            os.rename(candidate, release)
        if current:
            set_link(os.path.join(root, "previous"), current)
        set_link(os.path.join(root, "current"), release)
    protected = {release, current, link_target(os.path.join(root, "previous"))}
    releases_dir = os.path.join(root, "releases")
    result["removed"] = doomed(releases_dir, p["keep"], protected) if os.path.isdir(releases_dir) else []
    if not check:
        for path in result["removed"]:
            shutil.rmtree(path, ignore_errors=True)
    if module._diff:  # a new release's files from its archive: in check mode nothing was unpacked
        result["diff"] = rendered_diff(current, release, None if exists else base64.b64decode(p["content"]))
    return True, result


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, required_if=[("state", "live", ["release"])],
                           supports_check_mode=True)
    os.umask(0o022)
    root = module.params["root"]
    current = link_target(os.path.join(root, "current"))
    if module.params["state"] == "previous":
        if module.params["release"]:
            module.fail_json(msg="state=previous goes back to the release `previous` names: give no release.")
        release = previous_release(module, root, current)
    else:
        release = module.params["release"]
    changed, result = make_live(module, root, release, current)
    module.exit_json(changed=changed, **result)


if __name__ == "__main__":
    main()
