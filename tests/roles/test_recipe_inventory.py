"""inventory/production.example trains the recipe (configs/qwen3-8b.yaml): CT 200's training config, as
the dflash_release role renders it (its config.yaml.j2, the role's defaults, the playbooks' wiring in
vars/roles.yml, the example's group and host vars), is the recipe key for key once both are loaded by
the trainer. No sim: the play renders on the controller and connects to nothing."""

import dataclasses
import json
import sys

from dflash_ops.core.config import load_config
from pvesim.fleet import REPO, run_playbook

EXAMPLE = REPO / "inventory" / "production.example"
COLLECTION = REPO / "ansible_collections" / "dflash" / "ops"
TEMPLATE = COLLECTION / "roles" / "dflash_release" / "templates" / "config.yaml.j2"
RENDER = f"""---
- name: Render CT 200's training config as the release role does.
  hosts: ct200
  gather_facts: false
  vars_files:
    - {COLLECTION / "playbooks" / "vars" / "roles.yml"}
  tasks:
    - name: Read the release role's variables.
      ansible.builtin.import_role:
        name: dflash.ops.dflash_release
        tasks_from: variables
        rolespec_validate: false
    - name: Read the run role's variables.
      ansible.builtin.import_role:
        name: dflash.ops.dflash_run
        tasks_from: variables
        rolespec_validate: false
    - name: Render.
      ansible.builtin.copy:
        content: "{{{{ lookup('ansible.builtin.template', '{TEMPLATE}') }}}}"
        dest: "{{{{ rendered }}}}"
        mode: "0644"
      delegate_to: localhost
      vars:
        ansible_python_interpreter: {sys.executable}
"""


def test_the_example_inventory_renders_the_recipe(tmp_path):
    playbook = tmp_path / "render.yml"
    playbook.write_text(RENDER)
    rendered = tmp_path / "config.yaml"
    result = run_playbook(playbook, EXAMPLE, extravars={"rendered": str(rendered)})
    assert result.rc == 0, result.stdout[-3000:]
    from_inventory = load_config(rendered, check_target=False)
    recipe = load_config(REPO / "configs" / "qwen3-8b.yaml", check_target=False)
    differ = {f"{section}.{key}": (getattr(getattr(from_inventory, section), key), value)
              for section in ("model", "data", "optim", "run", "pipeline")
              for key, value in dataclasses.asdict(getattr(recipe, section)).items()
              if dataclasses.asdict(getattr(from_inventory, section))[key] != value}
    assert not differ, json.dumps(differ, default=str) + "\n" + rendered.read_text()
