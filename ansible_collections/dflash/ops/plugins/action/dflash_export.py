# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The controller's side of dflash.ops.dflash_export: the module exports in the container and lists its
files' sha256; this fetches them into a staging directory, checks each, and renames it into place."""

from __future__ import annotations

import json
import os
import shutil

from ansible.errors import AnsibleActionFail, AnsibleConnectionFailure
from ansible.plugins.action import ActionBase

from ansible_collections.dflash.ops.plugins.module_utils.export_files import (
    AUTO_MAP,
    MANIFEST,
    directory_checksums,
    export_problems,
    manifest_checksums,
    odd_names,
)
from ansible_collections.dflash.ops.plugins.module_utils.safe_fetch import (
    DIR_MODE,
    FILE_MODE,
    open_private_directory,
)
from ansible_collections.dflash.ops.plugins.module_utils.safe_paths import UnsafePath
from ansible_collections.dflash.ops.plugins.modules.dflash_export import ARGUMENT_SPEC

MODULE = "dflash.ops.dflash_export"
FORCE_HINT = "force: true (playbooks/export.yml: -e dflash_run_export_force=true)"


def differences(expected, found):
    """The names whose content differs between two {name: sha256} of a directory, each once."""
    return sorted(name for name in set(expected) | set(found) if expected.get(name) != found.get(name))


def copy_problems(expected, copied, listed):
    """What is wrong with a copy whose files have the sha256 `copied` and whose SHA256SUMS lists
    `listed`, when the container's files have `expected`."""
    others = {name: digest for name, digest in copied.items() if name != MANIFEST}
    return ([f"{name} (sha256 {copied.get(name, 'missing')}, in the container {expected.get(name, 'none')})"
             for name in differences(expected, copied)]
            + [f"{MANIFEST} does not list {name} as it is" for name in differences(listed, others)])


def auto_map_problems(config_path):
    """Why the copy's config.json would have a loader run other code than the export's own class."""
    try:
        with open(config_path, encoding="utf-8") as fh:
            auto_map = json.load(fh).get("auto_map")
    except (OSError, ValueError, AttributeError) as err:
        return [f"config.json cannot be read ({err})"]
    return [] if auto_map == AUTO_MAP else [f"config.json's auto_map is {auto_map}, not {AUTO_MAP}"]


def copy_decision(expected, here, check_mode, force):
    """`same`, `copy` or `refuse`: what becomes of the controller's directory, which holds `here`
    ({name: sha256}, None when missing), for an export whose files have `expected` (empty in check
    mode while the container has no export of the step yet: nothing to compare with until it has)."""
    if here is None:
        return "copy"
    if not expected and check_mode:
        return "copy"
    if here == expected:
        return "same"
    return "copy" if force else "refuse"


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        del tmp  # no effect
        args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)[1]
        try:
            module = self._execute_module(module_name=MODULE, module_args=args, task_vars=task_vars)
        finally:
            self._remove_tmp_path(self._connection._shell.tmpdir)
        result.update(module)
        if module.get("failed"):
            return result
        source, expected, check = module["dir"], module["files"], self._task.check_mode
        dest = result["dest"] = os.path.join(self._loader.path_dwim(args["dest"]), os.path.basename(source))
        if odd_names(expected):
            raise AnsibleActionFail(f"The export in {source} lists files that are not plain file names "
                                    f"({', '.join(odd_names(expected))}); nothing was copied.")
        # Its code is what the serving side runs (trust_remote_code): the release's own, or nothing taken.
        problems = export_problems(expected, module["code"]) if expected else []
        if problems:
            raise AnsibleActionFail(f"The export in {source} is not what the release that made it writes: "
                                    f"{'; '.join(problems)}. Nothing was copied to the controller; remove it "
                                    "in the container and export again.")
        try:
            os.close(open_private_directory(os.path.dirname(dest), create=not check))
            here = directory_checksums(dest)
        except FileNotFoundError:
            here = None  # check mode: it would be made
        except (UnsafePath, ValueError, OSError) as err:  # another user's directory, a link
            raise AnsibleActionFail(f"Cannot copy the export to the controller: {err}; nothing was copied. "
                                    "Fetch into a directory of your own that no other user may write.") \
                from err
        decision = copy_decision(expected, here, check, args["force"])
        if decision == "refuse":
            differing, host = ", ".join(differences(expected, here)), task_vars.get("inventory_hostname")
            raise AnsibleActionFail(
                f"The controller has another export at {dest} ({differing} differ from {source} in {host}); "
                f"it was left as it is. Move it away, fetch to another directory, or replace it: "
                f"{FORCE_HINT}.")
        result["fetched"] = sorted(expected) if decision == "copy" else []
        if decision == "same":
            result["msg"] = f"{module['msg']} The controller has the same files at {dest}."
        elif check:
            then = "" if here is None else " (then compared with the files there: replaced only with force)"
            result["msg"] = f"{module['msg']} Would copy it to {dest} on the controller{then}."
        else:
            self.copy_export(source, dest, expected, replace=here is not None)
            result["msg"] = (f"{module['msg']} Copied its {len(expected)} files to {dest} on the controller, "
                             "each with the container's sha256.")
        result["changed"] = module["changed"] or decision == "copy"
        return result

    def copy_export(self, source, dest, expected, replace):
        """Fetch every file of `expected` from `source` into a staging directory next to `dest`, check
        each file's sha256 and the copy's own SHA256SUMS, then rename it to `dest` (a `dest` there is
        renamed aside first and removed after)."""
        parent, name = os.path.split(dest)  # made 0700 and checked by run()
        staging = os.path.join(parent, f".{name}.partial-{os.getpid()}")
        aside = os.path.join(parent, f".{name}.replaced-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        os.mkdir(staging, DIR_MODE)
        try:
            for file_name in sorted(expected):
                self._connection.fetch_file(f"{source}/{file_name}", os.path.join(staging, file_name))
                os.chmod(os.path.join(staging, file_name), FILE_MODE)
            copied = directory_checksums(staging)
            with open(os.path.join(staging, MANIFEST), encoding="utf-8") as fh:
                problems = copy_problems(expected, copied, manifest_checksums(fh.read()))
            problems += auto_map_problems(os.path.join(staging, "config.json"))
            if problems:
                raise AnsibleActionFail(f"The copy of {source} does not match the container's files: "
                                        f"{'; '.join(problems)}. Nothing was put at {dest}; run it again.")
            if replace:
                os.rename(dest, aside)
            try:
                os.rename(staging, dest)
            except OSError:
                if replace:
                    os.rename(aside, dest)
                raise
            shutil.rmtree(aside, ignore_errors=True)
        except (AnsibleConnectionFailure, OSError) as err:
            raise AnsibleActionFail(f"Cannot copy {source} to {dest} on the controller: {err}") from err
        finally:
            shutil.rmtree(staging, ignore_errors=True)
