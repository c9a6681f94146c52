# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The controller's side of dflash.ops.dflash_fetch: the module reads the run's files in the container by
safe_fetch's rule and sends those the controller lacks; this writes them 0600 in a directory of the
controller's user (0700), never through a link."""

from __future__ import annotations

import base64
import os

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase

from ansible_collections.dflash.ops.plugins.module_utils.safe_fetch import (
    open_private_directory,
    private_checksums,
    write_private,
)
from ansible_collections.dflash.ops.plugins.module_utils.safe_paths import UnsafePath
from ansible_collections.dflash.ops.plugins.modules.dflash_fetch import ARGUMENT_SPEC

MODULE = "dflash.ops.dflash_fetch"


def controller_path(relative, paths):
    """Where the container's `relative` lands under dest: `paths` maps a file, or a directory whose files
    keep their path below it. None when no entry covers it."""
    for source, target in paths.items():
        source = source.strip("/")
        if relative == source:
            return target
        if relative.startswith(source + "/"):
            return f"{target.rstrip('/')}/{relative[len(source) + 1:]}"
    return None


def known_copies(dest, paths):
    """{container path: sha256} of the copies `dest` has of `paths` (dest made 0700 when missing, and
    refused by UnsafePath when not trusted, before the container is read)."""
    os.close(open_private_directory(dest))
    known = {}
    for source, target in paths.items():
        source, target = source.strip("/"), target.strip("/")
        for relative, digest in private_checksums(dest, target).items():
            known[source + relative[len(target):]] = digest
    return known


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        del tmp  # no effect
        args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)[1]
        dest = self._loader.path_dwim(args["dest"])
        try:
            known = known_copies(dest, args["paths"])
        except (UnsafePath, OSError) as exc:
            raise AnsibleActionFail(f"The controller's directory is not trusted: {exc}; nothing was copied. "
                                    "Use a directory of your own that no other user may write.") from None
        try:
            module = self._execute_module(module_name=MODULE, module_args=dict(args, have=known),
                                          task_vars=task_vars)
        finally:
            self._remove_tmp_path(self._connection._shell.tmpdir)
        result.update(module)
        if module.get("failed"):
            return result
        fetched = []
        try:
            for relative, info in sorted(module["files"].items()):
                content = info.pop("content", None)
                target = controller_path(relative, args["paths"])
                if target is not None and content is not None:
                    write_private(dest, target, base64.b64decode(content))
                    fetched.append(target)
        except (UnsafePath, OSError) as exc:
            raise AnsibleActionFail(f"Cannot write the run's files on the controller: {exc}; nothing more "
                                    "was copied.") from None
        result.update(changed=bool(fetched), fetched=fetched, dest=dest)
        return result
