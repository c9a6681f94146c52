"""Unit tests of the dflash.ops.preflight filter's checks, called directly on inventories written as
dicts: what playbooks/preflight.yml refuses on the controller, and the words it refuses it with."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ansible_collections.dflash.ops.plugins.filter import preflight
from ansible_collections.dflash.ops.plugins.module_utils.run_pidfile import is_plain_file_name

REPO = Path(__file__).resolve().parents[2]
ROLES = REPO / "ansible_collections" / "dflash" / "ops" / "roles"
# The roles the playbook checks the variables of, as it names them.
PLAYBOOK_ROLES = yaml.safe_load((ROLES.parent / "playbooks" / "preflight.yml").read_text())[0]["vars"][
    "__dflash_preflight_roles"]


def role_options(roles=PLAYBOOK_ROLES):
    """The roles' main options merged, as the playbook merges what the role_argument_spec lookup gives."""
    specs = {}
    for role in roles:
        entry_points = yaml.safe_load((ROLES / role / "meta" / "argument_specs.yml").read_text())
        specs.update(entry_points["argument_specs"]["main"]["options"])
    return specs


SPECS = role_options()
NODES = {"pve1": {"ansible_host": "192.0.2.1"}, "pve2": {"ansible_host": "192.0.2.2", "ansible_port": 2222}}
GOOD = {"ansible_connection": "dflash.ops.pct_pipelined", "ansible_host": "192.0.2.1", "proxmox_vmid": 200,
        "proxmox_node": "pve1"}


def inventory(**containers):
    """(hostvars, groups) of NODES and the given containers (name -> their variables)."""
    groups = {"proxmox_hosts": list(NODES), "training_containers": list(containers)}
    return {**NODES, **containers}, groups


def test_a_good_container_has_no_problem_in_any_check():
    hostvars, groups = inventory(ct200=GOOD)
    for check in preflight.CHECKS:
        assert preflight.preflight("ct200", check, hostvars, groups=groups, play_hosts=["ct200"], specs=SPECS,
                                   roles=PLAYBOOK_ROLES) == [], check


def test_an_unknown_check_is_named_with_the_checks_there_are():
    with pytest.raises(preflight.AnsibleFilterError,
                       match="has no check 'inventroy' .*it has inventory, run_members"):
        preflight.preflight("ct200", "inventroy", {})


@pytest.mark.parametrize("vmid, accepted", [(200, True), ("999999999", True), (99, False),
                                            (1000000000, False), ("0200", False), ("ct200", False),
                                            (None, False)])
def test_the_vmid_must_be_a_ct_id(vmid, accepted):
    hostvars, groups = inventory(ct200={**GOOD, "proxmox_vmid": vmid})
    problems = preflight.container_problems("ct200", hostvars, groups)
    assert (problems == []) == accepted, problems
    if not accepted:
        assert f'proxmox_vmid is "{vmid}".' in problems[0]


def test_a_container_without_vmid_node_and_connection_gets_one_sentence_each_and_the_example():
    hostvars, groups = inventory(ct200={})
    problems = preflight.container_problems("ct200", hostvars, groups)
    assert problems == [
        "a training container needs proxmox_vmid, its numeric CT id (100 to 999999999, as `pct list` on its "
        'node shows it); proxmox_vmid is "unset".',
        "a training container needs proxmox_node, the inventory name of its Proxmox node (a host of group "
        'proxmox_hosts: pve1, pve2); proxmox_node is "unset". Fix it, or list the node under proxmox_hosts.',
        "a training container needs ansible_connection: dflash.ops.pct_pipelined (the project's "
        "community.proxmox.proxmox_pct_remote with pipelining; that one works too, slower): its tasks run "
        "through its node's pct; set it in group_vars/training_containers.yml. "
        'ansible_connection is "unset".',
        "See inventory/production.example/."]


@pytest.mark.parametrize("address, complaint", [
    ({"ansible_host": "192.0.2.2"}, "they are 192.0.2.2:22, pve2 is at 192.0.2.2:2222."),
    ({"ansible_host": "192.0.2.2", "ansible_port": 22}, "they are 192.0.2.2:22, pve2 is at 192.0.2.2:2222."),
    ({}, "they are ct200:22, pve2 is at 192.0.2.2:2222."),
    ({"ansible_host": "192.0.2.2", "ansible_port": 2222}, None),
])
def test_a_container_is_reached_at_its_node_s_address(address, complaint):
    container = {key: value for key, value in GOOD.items() if key != "ansible_host"}
    hostvars, groups = inventory(ct200={**container, **address, "proxmox_node": "pve2"})
    problems = preflight.container_problems("ct200", hostvars, groups)
    assert problems == ([] if complaint is None else [
        "a training container is reached through its node, so its ansible_host and ansible_port must be the "
        f"node's: {complaint}", "See inventory/production.example/."])


MEMBERS = [{"host": "ct200", "drafters": 1, "targets": 1}, {"host": "ct201", "drafters": 1, "targets": 1}]


def member(members, address="192.0.2.20"):
    return {**GOOD, "dflash_run_members": members, "dflash_run_address": address}


def test_a_run_declared_alike_on_its_members_and_all_in_the_play_passes():
    hostvars, groups = inventory(ct200=member(MEMBERS), ct201=member(MEMBERS, "192.0.2.21"))
    for host in ("ct200", "ct201"):
        assert preflight.run_members_problems(host, hostvars, groups, ["ct200", "ct201"]) == []


def test_members_declared_in_another_order_without_an_address_are_refused_on_each_member():
    hostvars, groups = inventory(ct200=member(MEMBERS), ct201=member(MEMBERS[::-1], ""))
    for host in ("ct200", "ct201"):
        assert preflight.run_members_problems(host, hostvars, groups, ["ct200", "ct201"]) == [
            "the members of a run must declare the same dflash_run_members (in the same order) on every "
            "member.",
            "every member needs dflash_run_address, the address the other members reach it at."]


def test_a_limit_that_leaves_a_member_out_is_refused():
    hostvars, groups = inventory(ct200=member(MEMBERS), ct201=member(MEMBERS, "192.0.2.21"))
    assert preflight.run_members_problems("ct200", hostvars, groups, ["ct200"]) == [
        "a run across containers is deployed, stopped and shown as one: the play (-l) must include all its "
        "members (ct200, ct201), it leaves out ct201."]


def test_members_that_do_not_name_the_container_or_are_not_containers_are_named():
    members = [{"host": "ct201"}, {"host": "ct9"}, {"drafters": 1}]
    hostvars, groups = inventory(ct200=member(members), ct201=GOOD)
    problems = preflight.run_members_problems("ct200", hostvars, groups, ["ct200", "ct201"])
    assert problems[:2] == ["its dflash_run_members (ct201, ct9, ) does not name it.",
                            "dflash_run_members names ct9, , not in group training_containers."]


def test_a_container_of_its_own_has_no_members_to_check():
    hostvars, groups = inventory(ct200={**GOOD, "dflash_run_members": []})
    assert preflight.run_members_problems("ct200", hostvars, groups, []) == []


def test_a_wrong_type_is_refused_in_the_words_of_ansible_s_validation_with_the_fix():
    [problem] = preflight.variable_type_problems({**GOOD, "dflash_run_stop_timeout": "soon",
                                                  "dflash_release_device": "tpu"}, SPECS)
    assert problem.startswith("argument 'dflash_run_stop_timeout' is of type str and we were unable to "
                              "convert to int")
    assert ("; value of dflash_release_device must be one of: cpu, cuda, got: tpu. Fix the value in the "
            "inventory") in problem
    assert preflight.variable_type_problems({**GOOD, "dflash_run_stop_timeout": "60"}, SPECS) == []


def test_a_misspelt_role_variable_is_named_and_other_variables_are_not():
    host_vars = {**GOOD, "dflash_run_stop_timout": 600, "proxmox_host_vmidd": 3,
                 "dflash_run_stop_timeout": 60, "dflashy": 1, "my_dflash_run_x": 1}
    assert preflight.variable_name_problems(host_vars, SPECS, PLAYBOOK_ROLES) == [
        "dflash_run_stop_timout, proxmox_host_vmidd is not a variable of any role (the proxmox_host, "
        "proxmox_provision, dflash_env, dflash_release, dflash_run roles have no such name, so it would "
        "change nothing). Fix its name in the inventory or in -e; the variables are listed in "
        "ansible_collections/dflash/ops/roles/<role>/defaults/main.yml."]


@pytest.mark.parametrize("name", ["../../../etc/cron.d/evil", "runs/main", ".main", "..", ""])
def test_a_run_name_that_is_not_a_plain_file_name_is_refused_naming_it_and_the_fix(name):
    assert not is_plain_file_name(name)  # the rule training_run applies in the container
    assert preflight.run_name_and_path_problems({"dflash_run_name": name}, SPECS) == [
        f'dflash_run_name is "{name}": the run\'s name must be a plain file name (no \'/\', not starting '
        "with '.'), as its pidfile, log and secrets file in the container are named after it. Fix it in the "
        "inventory or in -e (the default is main)."]


@pytest.mark.parametrize("name", ["main", "run-2", "main.v2"])
def test_a_plain_run_name_passes(name):
    assert preflight.run_name_and_path_problems({"dflash_run_name": name}, SPECS) == []


# The role options that are paths in the container or on its node: every path option of the specs but
# the controller's.
CONTAINER_PATH_OPTIONS = sorted(name for name, spec in SPECS.items()
                                if spec["type"] == "path" and name not in preflight.CONTROLLER_PATHS)


def test_the_container_paths_are_the_roles_root_dir_venv_and_path_variables():
    for name in ("dflash_env_venv", "dflash_release_root", "dflash_release_venv",
                 "dflash_release_output_dir", "dflash_release_target_path", "dflash_release_data_path",
                 "dflash_run_root", "dflash_run_pidfile", "dflash_run_log_path", "dflash_run_output_dir",
                 "dflash_run_secret_file", "proxmox_host_pct_path"):
        assert name in CONTAINER_PATH_OPTIONS


@pytest.mark.parametrize("name", CONTAINER_PATH_OPTIONS)
def test_a_relative_container_path_is_refused_naming_the_variable_its_value_and_the_fix(name):
    assert preflight.run_name_and_path_problems({name: "/srv/x"}, SPECS) == []
    assert preflight.run_name_and_path_problems({name: "srv/x"}, SPECS) == [
        f'{name} is "srv/x", and "srv/x" is not an absolute path: the roles use it in the container or on '
        "its node, where tasks run from no fixed directory. Fix it in the inventory (group_vars, host_vars) "
        "or in -e with a path that starts with /."]


@pytest.mark.parametrize("value", ["~/venv", "./venv", ""])
def test_a_path_the_container_s_shell_would_resolve_is_not_absolute(value):
    assert preflight.run_name_and_path_problems({"dflash_env_venv": value}, SPECS) != []


def test_each_relative_element_of_a_list_of_paths_is_named():
    [problem] = preflight.run_name_and_path_problems(
        {"dflash_env_site_packages": ["/usr/lib/python3/dist-packages", "lib", "x/y"]}, SPECS)
    assert problem.startswith('dflash_env_site_packages is ["/usr/lib/python3/dist-packages", "lib", "x/y"], '
                              'and "lib", "x/y" is not an absolute path')


@pytest.mark.parametrize("name", sorted(preflight.CONTROLLER_PATHS))
def test_a_controller_path_may_be_relative_to_where_the_playbook_runs(name):
    assert SPECS[name]["type"] == "path"
    assert preflight.run_name_and_path_problems({name: "../dflash"}, SPECS) == []
