# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The controller's half of dflash.ops.dflash_release_tree: with `build`, render this container's files
from the role's templates, pack the release (the trainer's code and those files) into the controller's
archive cache and hand its base64 text to the module as `content`, naming the release after its content;
after the module, turn a release that does not validate into a failure that names the inventory variable
to fix (`fix_variables`). A name of the build's `environment` (what run.sh exports in the clear) that looks
like a secret's is refused before anything is built or sent, with where secrets go instead, unless the build's
`environment_allowed` (dflash_release_environment_allowed) names it.

A container's release is one task: no render, pack, name or check tasks of its own on the controller. The
templates are rendered with the task's variables as they are (the template lookup would deep-copy all of
them for each file first).
"""

from __future__ import annotations

import json
import re

from ansible.errors import AnsibleError
from ansible.plugins.action import ActionBase
from ansible.template import trust_as_template
from ansible.utils.display import Display

from ansible_collections.dflash.ops.plugins.plugin_utils.release_pack import pack

display = Display()
MODULE = "dflash.ops.dflash_release_tree"
# Options the controller consumes; the module never sees them.
CONTROLLER_OPTIONS = ("build", "fix_variables")
BUILD_KEYS = ("code_dir", "dest_dir", "revision", "templates")
# The variable named for a config key no fix_variables entry names: a key of the free-form settings.
SETTINGS_VARIABLE = "dflash_release_settings"
# A name of the build's environment (what run.sh exports in the clear, kept in the controller's cache)
# that says it holds a secret.
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD", re.IGNORECASE)


def secret_like_names(environment):
    """The names of `environment` that look like a secret's, sorted."""
    return sorted(str(name) for name in environment or {} if SECRET_NAME.search(str(name)))


def refused_secret_names(environment, allowed=()):
    """The names of `environment` that look like a secret's and `allowed` does not name, sorted."""
    return [name for name in secret_like_names(environment) if name not in {str(a) for a in allowed or ()}]


def secret_environment_refusal(names):
    """The deploy's refusal of names of dflash_release_environment that look like secrets."""
    return (f"dflash_release_environment sets {', '.join(names)}, which look like secrets: run.sh would "
            "export them in the clear, readable in the container and in the controller's release cache, so "
            "nothing was built or changed. Put secrets in dflash_run_secret_environment instead, in a vars "
            "file encrypted by Ansible Vault (the README: ansible-vault create secrets.yml, then -e "
            "@secrets.yml): the start reads them from a file root alone can read. A name that only looks "
            "like a secret's (TOKENIZERS_PARALLELISM) goes in dflash_release_environment_allowed.")


def verdict_of(validation):
    """The trainer's answer to `validate --json`: {"ok": false, "config": path, "key": ..., "message": ...},
    or {} when it printed something else."""
    text = (validation.get("stdout") or "").strip()
    try:
        verdict = json.loads(text) if text.startswith("{") else {}
    except ValueError:
        return {}
    return verdict if isinstance(verdict, dict) else {}


def validation_failure(host, result, fix_variables):
    """The message of a release that does not validate: the trainer's words and the variable to fix."""
    validation = result.get("validation") or {}
    verdict = verdict_of(validation)
    if "key" in verdict:
        problem = f"invalid config {verdict.get('config')}: {verdict['key']}: {verdict.get('message')}"
        key = str(verdict["key"]).split("[", maxsplit=1)[0]  # pipeline.target_gpus[2] -> pipeline.target_gpus
    else:
        problem = ((validation.get("stderr") or "").strip() or (validation.get("stdout") or "").strip()
                   or validation.get("msg") or "no output")
        key = "model"
    variable = fix_variables.get(key) or f"{SETTINGS_VARIABLE}.{key}"
    release = (result.get("release") or "").rstrip("/").rsplit("/", 1)[-1]
    return (f"Release {release} in {host} does not validate ({validation.get('dir', '')}/config.yaml): "
            f"{problem}. Fix {variable} in the inventory (or -e) and deploy again. The live release and the "
            f"running run were left as they were.")


class ActionModule(ActionBase):
    TRANSFERS_FILES = False

    def render(self, template):
        """A template of the role (its templates/ directory) rendered with the task's variables, as the
        template lookup renders it (blocks trimmed, backslashes as they are)."""
        path = self._find_needle("templates", template)
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        return str(self._templar.template(trust_as_template(text), escape_backslashes=False,
                                          overrides=dict(trim_blocks=True)))

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        build = args.pop("build", None)
        fix_variables = dict(args.pop("fix_variables", None) or {})
        built = None
        if build:
            missing = [key for key in BUILD_KEYS if key not in build]
            if missing or "release" in args or "content" in args:
                return dict(result, failed=True, msg=f"build needs {', '.join(BUILD_KEYS)} (missing: "
                            f"{', '.join(missing) or 'none'}) and takes the place of release and content")
            if names := refused_secret_names(build.get("environment"), build.get("environment_allowed")):
                return dict(result, failed=True, msg=secret_environment_refusal(names))
            try:
                files = {name: self.render(template) for name, template in build["templates"].items()}
                built = pack(build["code_dir"], build["dest_dir"], build["revision"] or "unknown", files,
                             build.get("exclude") or ())
            except (OSError, ValueError, AnsibleError) as exc:
                return dict(result, failed=True, msg=f"cannot build the release on the controller: {exc}")
            args["release"] = f"{str(args['root']).rstrip('/')}/releases/{built['id']}"
            args["content"] = built.pop("content")  # verified against the id, not read from the cache again
        result.update(self._execute_module(module_name=MODULE, module_args=args, task_vars=task_vars))
        if built:
            result["built"] = built
            for problem in built["rebuilt"]:
                display.warning(f"the controller's release cache was not trusted: {problem}; rebuilt it "
                                f"from the source (check who can write {build['dest_dir']})")
        if result.get("validated") is False:
            host = (task_vars or {}).get("inventory_hostname", "the container")
            result.update(failed=True, msg=validation_failure(host, result, fix_variables))
        return result
