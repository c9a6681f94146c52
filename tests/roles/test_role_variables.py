"""Each role reads only its own variables; what one role needs of another's reaches it through the
playbooks (the collection's playbooks/vars/roles.yml), from the one variable that owns the value."""

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
ROLES_DIR = REPO / "ansible_collections" / "dflash" / "ops" / "roles"
ROLES = sorted(p.name for p in ROLES_DIR.iterdir() if (p / "meta" / "argument_specs.yml").exists())
ROLE_VARIABLE = re.compile(rf"\b(?<!__)({'|'.join(ROLES)})_[a-z0-9_]+")
PLAYBOOKS = REPO / "ansible_collections" / "dflash" / "ops" / "playbooks"
WIRING = yaml.safe_load((PLAYBOOKS / "vars" / "roles.yml").read_text())


def code_lines(path):
    """What Ansible evaluates in a role file: its lines without comments (YAML and Jinja)."""
    text = re.sub(r"\{#.*?#\}", "", path.read_text(), flags=re.S)
    return [line for line in text.splitlines() if not line.lstrip().startswith("#")]


def options(role):
    specs = yaml.safe_load((ROLES_DIR / role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    return {name for entry in specs.values() for name in entry.get("options") or {}}


@pytest.mark.parametrize("role", ROLES)
def test_a_role_reads_only_its_own_variables(role):
    strangers = set()
    for kind in ("tasks", "defaults", "vars", "templates", "handlers"):
        for path in sorted((ROLES_DIR / role / kind).glob("*")):
            for line in code_lines(path):
                strangers |= {(path.relative_to(ROLES_DIR).as_posix(), match.group(0))
                              for match in ROLE_VARIABLE.finditer(line) if match.group(1) != role}
    assert not strangers, f"{role} reads other roles' variables: {sorted(strangers)}"


def test_what_the_playbooks_pass_on_is_a_variable_of_the_role_that_gets_it():
    all_options = {role: options(role) for role in ROLES}
    for name in WIRING:
        role = next(r for r in ROLES if name.startswith(r + "_"))
        assert name in all_options[role], f"vars/roles.yml passes {name}, not an option of {role}"
        # And from another role's variables: a role never passes a value to itself.
        value = str(WIRING[name])
        assert {m.group(1) for m in ROLE_VARIABLE.finditer(value)} - {role}, f"{name}: {value}"


def runs_a_role(tasks):
    """Whether `tasks` (a play's, blocks included) run a role's tasks: a role imported or included for more
    than its variables, or one of playbooks/tasks/, which do."""
    for task in tasks or []:
        for key in ("block", "rescue", "always"):
            if runs_a_role(task.get(key)):
                return True
        for action in ("ansible.builtin.import_role", "ansible.builtin.include_role"):
            if action in task and task[action].get("tasks_from") != "variables":
                return True
        for action in ("ansible.builtin.import_tasks", "ansible.builtin.include_tasks"):
            target = task.get(action, "")
            if str(target.get("file", "") if isinstance(target, dict) else target).startswith("tasks/"):
                return True
    return False


def test_every_play_that_runs_a_role_loads_what_the_roles_pass_on():
    plays = [(path.name, play) for path in sorted(PLAYBOOKS.glob("*.yml"))
             for play in yaml.safe_load(path.read_text()) if "hosts" in play]
    running = [(name, play) for name, play in plays if runs_a_role(play.get("tasks"))]
    assert len(running) == 11, [play["name"] for _, play in running]
    for name, play in running:
        assert "vars/roles.yml" in play.get("vars_files", []), f"{name}: {play['name']} runs a role"


def test_no_debug_task_notifies_a_handler():
    """A handler or a restart follows the task that really changed something, never a debug task whose
    changed_when stands in for a change (check mode's reports of what would change notify nothing)."""
    notifying = [(path.relative_to(ROLES_DIR).as_posix(), task.get("name"))
                 for path in sorted(ROLES_DIR.glob("*/tasks/*.yml"))
                 for task in yaml.safe_load(path.read_text()) or []
                 if "ansible.builtin.debug" in task and "notify" in task]
    assert not notifying, notifying
