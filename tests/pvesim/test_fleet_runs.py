"""pvesim.fleet's Ansible runs through ansible-runner, on localhost: results, recap and per-task timing
come from the event stream; every run gets the project's ansible.cfg, whatever the working directory."""

import time

import pytest
import yaml

from pvesim.fleet import REPO, local_inventory, run_module, run_playbook

PLAYBOOK = [{
    "name": "Events of every kind.",
    "hosts": "localhost",
    "gather_facts": False,
    "tasks": [
        {"name": "Sleep a little.", "ansible.builtin.command": "sleep 1.2", "changed_when": False},
        {"name": "Echo each item.", "ansible.builtin.command": "echo {{ item }}", "loop": ["a", "b"]},
        {"name": "Skip this.", "ansible.builtin.debug": {"msg": "never"}, "when": False},
        {"name": "Fail and go on.", "ansible.builtin.fail": {"msg": "expected failure"},
         "ignore_errors": True},
        {"name": "Report the settings.", "ansible.builtin.debug": {"msg": {
            "config": "{{ lookup('ansible.builtin.env', 'ANSIBLE_CONFIG') }}",
            "host_key_checking": "{{ lookup('ansible.builtin.config', 'HOST_KEY_CHECKING') }}",
            "marker": "{{ lookup('ansible.builtin.env', 'DFLASH_TEST_MARKER') }}",
            "extra": "{{ extra_value | default('') }}"}}},
    ],
}]


@pytest.fixture
def played(tmp_path, monkeypatch):
    playbook = tmp_path / "events.yml"
    playbook.write_text(yaml.safe_dump(PLAYBOOK, sort_keys=False))
    monkeypatch.chdir(tmp_path)  # no run depends on the caller's working directory
    return run_playbook(playbook, local_inventory(tmp_path), extravars={"extra_value": "x1"},
                        envvars={"DFLASH_TEST_MARKER": "m1"}, timeout=120)


def test_results_and_recap_come_from_the_events(played):
    assert played.rc == 0 and played.status == "successful", played
    assert played.plays == ["Events of every kind."]
    assert [t.name for t in played.tasks] == ["Sleep a little.", "Echo each item.", "Skip this.",
                                              "Fail and go on.", "Report the settings."]
    items = played.results("Echo each item.")["localhost"]["results"]
    assert [i["stdout"] for i in items] == ["a", "b"]
    assert played.results("Skip this.")["localhost"]["skipped"] is True
    assert played.tasks[2].ran == []
    assert played.messages() == "localhost: expected failure"
    assert played.stats["localhost"] == {"ok": 4, "changed": 1, "failures": 0, "unreachable": 0,
                                         "skipped": 1, "rescued": 0, "ignored": 1}


def test_each_task_has_its_time(played):
    seconds = {name: s for name, host, s in played.task_seconds() if host == "localhost"}
    assert set(seconds) == {t.name for t in played.tasks}
    assert 1.2 <= seconds["Sleep a little."] < 30
    sleep = played.tasks[0]
    assert sleep.action == "ansible.builtin.command" and 1.2 <= sleep.seconds < 30
    assert sleep.end <= played.tasks[1].start


def test_the_run_gets_the_project_config_and_the_callers_settings(played):
    settings = played.results("Report the settings.")["localhost"]["msg"]
    assert settings == {"config": str(REPO / "ansible.cfg"), "host_key_checking": True, "marker": "m1",
                        "extra": "x1"}


def test_a_module_runs_ad_hoc(tmp_path):
    res = run_module("ansible.builtin.command", "echo ad-hoc", local_inventory(tmp_path), "localhost",
                     timeout=120)
    assert res.rc == 0, res
    [task] = res.tasks
    assert task.hosts["localhost"]["stdout"] == "ad-hoc" and task.seconds_by_host["localhost"] > 0


def one_task_playbook(directory, task):
    playbook = directory / "one.yml"
    playbook.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "tasks": [task]}]))
    return playbook


def test_a_failed_play_says_why(tmp_path):
    playbook = one_task_playbook(tmp_path, {"name": "Fail.", "ansible.builtin.fail": {"msg": "it broke"}})
    res = run_playbook(playbook, local_inventory(tmp_path), timeout=120)
    assert res.rc == 2 and res.status == "failed" and res.messages() == "localhost: it broke"
    assert res.stats["localhost"]["failures"] == 1 and "it broke" in str(res)


def test_a_run_past_its_timeout_is_ended(tmp_path):
    playbook = one_task_playbook(tmp_path, {"name": "Hang.", "ansible.builtin.command": "sleep 60"})
    started = time.monotonic()
    res = run_playbook(playbook, local_inventory(tmp_path), timeout=5)
    assert res.status == "timeout" and res.rc != 0, res
    assert time.monotonic() - started < 40
