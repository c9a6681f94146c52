#!/usr/bin/python
# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
# Ansible modules keep their imports below the documentation blocks.
# ruff: noqa: E402
from __future__ import annotations

DOCUMENTATION = r"""
---
module: dflash_export
short_description: Export a training run's checkpoint as a drafter and fetch it to the controller, checksummed
description:
  - In the container, the trainer's own C(python -m dflash_ops.export --into) (from O(code_dir), run by
    O(python)) exports the latest complete checkpoint of the run in O(output_dir), or the one of
    O(step), into C(<into>/step-<N>/) (C(config.json), C(model.safetensors), C(modeling_dflash.py),
    C(drafter.py), C(README.md) and C(SHA256SUMS), the sha256 of the others, written last). The trainer
    picks the checkpoint by the rule it resumes by (a C(step-*) directory with all its files), in the
    same process that reads it, so a run that goes on saving and pruning checkpoints meanwhile does
    not matter.
  - An export already there that its C(SHA256SUMS) still matches, of the same O(dtype), is kept; with
    O(step), even when the run has removed that checkpoint since (it keeps only its latest few).
  - No checkpoint yet, a step the run does not have, and a step the run is still writing fail with
    the trainer's sentence (which names the steps there), before anything is written.
  - O(into) must be root's (made with mode 0700 when missing) and not reached through a link, as an export in
    a directory another user may write (the output directory of a run as C(dflash_run_user)) could be that
    user's code, which C(AutoModel.from_pretrained(..., trust_remote_code=True)) runs. Every file of the
    export is read as a regular file of root's, not through a link, and the controller refuses an export
    whose C(modeling_dflash.py) or C(drafter.py) is not the release's own (O(code_dir)), that holds other
    files than an export's, or whose C(config.json) names other code in C(auto_map).
  - On the controller (the action plugin of the same name), each file is fetched into a staging
    directory next to C(<dest>/step-<N>/), its sha256 checked against the container's, and the
    directory renamed into place (directories 0700, files 0600; O(dest) made 0700 when missing and
    refused when another user's or a link). A C(<dest>/step-<N>/) that already holds the same files is left as
    it is; one with other contents fails the task unless O(force), and is never half replaced.
version_added: "0.3.0"
author: dflash-ops contributors (@dflash-ops)
extends_documentation_fragment:
  - dflash.ops.attributes
attributes:
  action:
    description: Runs an action plugin on the controller around the module.
    support: full
    details: The fetch, the checks and the directory on the controller are the action plugin's.
  check_mode:
    support: full
    details:
      Names the checkpoint it would export and what it would fetch; writes nothing in the container or on
      the controller (C(dflash_ops.export --plan)).
options:
  output_dir:
    description: The run's output directory in the container (C(run.output_dir); its C(checkpoints/)).
    type: path
    required: true
  step:
    description: The step of the checkpoint to export; without it, the latest complete one.
    type: int
  into:
    description:
      - The directory in the container that holds the exports, one C(step-<N>) directory each; root's, 0700.
    type: path
    required: true
  dtype:
    description: The weight dtype of the export.
    type: str
    choices: [bfloat16, float32]
    default: bfloat16
  python:
    description: The Python of the trainer's venv in the container.
    type: path
    required: true
  code_dir:
    description: The directory that holds the trainer's C(dflash_ops) package in the container (a release).
    type: path
    required: true
  dest:
    description: The directory on the controller that receives C(step-<N>/); created when missing.
    type: path
    required: true
  force:
    description: Replace a C(<dest>/step-<N>/) whose contents differ from the export.
    type: bool
    default: false
"""

EXAMPLES = r"""
- name: Ensure the run's latest checkpoint is exported and on the controller.
  dflash.ops.dflash_export:
    output_dir: /var/lib/dflash/runs/main
    into: /var/lib/dflash/exports/main
    python: /opt/dflash/venv/bin/python
    code_dir: /opt/dflash/current
    dest: /srv/drafters/ct200
  register: export

- name: Export the checkpoint of step 1200 in float32, replacing an earlier copy.
  dflash.ops.dflash_export:
    output_dir: /var/lib/dflash/runs/main
    step: 1200
    dtype: float32
    into: /var/lib/dflash/exports/main
    python: /opt/dflash/venv/bin/python
    code_dir: /opt/dflash/current
    dest: /srv/drafters/ct200
    force: true
"""

RETURN = r"""
checkpoint:
  description:
    The checkpoint exported (in check mode, that would be); null when an export of O(step) was kept after
    the run removed its checkpoint.
  type: str
  returned: success
step:
  description: Its step.
  type: int
  returned: success
dir:
  description: The export's directory in the container, C(<into>/step-<N>).
  type: str
  returned: success
dtype:
  description: The weight dtype of the export.
  type: str
  returned: success
exported:
  description:
    Whether the export was written now (in check mode, would be); V(false) when an export there already
    matched its C(SHA256SUMS).
  type: bool
  returned: success
files:
  description:
    - Each file of the export with its sha256 in the container (C(SHA256SUMS) too); empty in check
      mode when the container has no export of that step yet.
  type: dict
  returned: success
code:
  description:
    The sha256 of the release's code files that its exports carry (C(modeling_dflash.py), C(drafter.py)).
  type: dict
  returned: success
dest:
  description: The export's directory on the controller, C(<dest>/step-<N>) (action plugin).
  type: str
  returned: success
fetched:
  description:
    The files copied to the controller (action plugin); in check mode, those that would be when the
    container has the export already (none are known while it would first write it).
  type: list
  elements: str
  returned: success
cmd:
  description: The export command run in the container.
  type: list
  elements: str
  returned: always
"""

import json
import os

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.dflash.ops.plugins.module_utils.export_files import (
    release_code_checksums,
    trusted_checksums,
)
from ansible_collections.dflash.ops.plugins.module_utils.safe_fetch import open_private_directory
from ansible_collections.dflash.ops.plugins.module_utils.safe_paths import UnsafePath

ARGUMENT_SPEC = {
    "output_dir": {"type": "path", "required": True},
    "step": {"type": "int"},
    "into": {"type": "path", "required": True},
    "dtype": {"type": "str", "choices": ["bfloat16", "float32"], "default": "bfloat16"},
    "python": {"type": "path", "required": True},
    "code_dir": {"type": "path", "required": True},
    "dest": {"type": "path", "required": True},
    "force": {"type": "bool", "default": False},
}


# (check mode, written now) -> how the result says it.
VERBS = {(False, True): "Wrote", (False, False): "Kept",
         (True, True): "Would write", (True, False): "Would keep"}


def export_command(params, plan):
    """The trainer's export command for the module's parameters (`--plan`: only say what it would do)."""
    argv = [params["python"], "-m", "dflash_ops.export", "--checkpoint", params["output_dir"],
            "--into", params["into"], "--dtype", params["dtype"]]
    if params["step"] is not None:
        argv += ["--step", str(params["step"])]
    return argv + (["--plan"] if plan else [])


def last_json_line(text):
    """The last line of `text` that is a JSON object, as data (None without one)."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def failure_reason(stdout, stderr):
    """The trainer's own sentence (its `error: ...` line), else the end of what it printed."""
    errors = [line[len("error: "):] for line in stderr.splitlines() if line.startswith("error: ")]
    if errors:
        return errors[-1]
    lines = [line for line in (stderr + stdout).splitlines() if line.strip()]
    return " ".join(lines[-3:]) or "no output"


def main():
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    p = module.params
    cmd = export_command(p, module.check_mode)
    where = f"the run's checkpoints in {p['output_dir']}"
    if not os.path.isfile(p["python"]):
        module.fail_json(msg=f"Cannot export {where}: the trainer's Python {p['python']} is missing (deploy "
                             "the run's environment first: playbooks/deploy.yml).", cmd=cmd)
    try:
        # Root's alone (0700, made so when missing): no other user, the run's own neither, can put an
        # export there for the controller to take. The code it copies is the release's, read as root's.
        os.close(open_private_directory(p["into"], create=not module.check_mode))
    except FileNotFoundError:
        pass  # check mode: it would be made
    except UnsafePath as exc:
        module.fail_json(msg=f"Cannot export {where} into {p['into']}: {exc}; an export there could be "
                             "anyone's. Export into a directory of root's that no other user may write "
                             "(dflash_run_export_container_dir).", cmd=cmd)
    try:
        code = release_code_checksums(p["code_dir"])
    except (UnsafePath, OSError) as exc:
        module.fail_json(msg=f"Cannot export {where}: the release's code is not trusted: {exc}", cmd=cmd)
    rc, out, err = module.run_command(cmd, environ_update={"PYTHONPATH": p["code_dir"]}, cwd=p["code_dir"],
                                      expand_user_and_vars=False)
    report = last_json_line(out) if rc == 0 else None
    if report is None:
        module.fail_json(msg=f"Cannot export {where}: {failure_reason(out, err)}", cmd=cmd, rc=rc,
                         stdout=out, stderr=err)
    exported = not report["exists"] if module.check_mode else not report["reused"]
    files = {}
    if not (module.check_mode and exported):
        try:  # every file there, each read as root's without following a link: what the controller takes
            files = trusted_checksums(report["out"])
        except (UnsafePath, OSError) as exc:
            module.fail_json(msg=f"Cannot export {where}: the export is not trusted: {exc}", cmd=cmd)
    verb = VERBS[module.check_mode, exported]
    module.exit_json(changed=exported, cmd=cmd, checkpoint=report["checkpoint"], step=report["step"],
                     dir=report["out"], dtype=report["dtype"], exported=exported, files=files, code=code,
                     msg=f"{verb} the export of step {report['step']} of {p['output_dir']} at "
                         f"{report['out']} in the container.")


if __name__ == "__main__":
    main()
