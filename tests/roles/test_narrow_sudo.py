"""The narrow sudo rule (inventory/production.example/sudoers.d/ansible_pct.narrow) is enough for the
day-to-day playbooks: a node user with it and nothing else deploys, restarts, reads the status and stops
a run, while pct's commands that are root on the node (push, pull, mount, set, create) and the
containers the rule does not name are refused. docs/SECURITY.md says what each rule grants.

The tests share one sim and run in order. Its node user is one of its own, so that no other sim's rule
for the same user (a broad one: sudo reads every file of /etc/sudoers.d) can make these pass.
"""

import pytest

from pvesim.fleet import REPO, Fleet

pytestmark = [pytest.mark.sim, pytest.mark.slow]

USER = "pctnarrow"
NARROW_RULE = REPO / "inventory" / "production.example" / "sudoers.d" / "ansible_pct.narrow"
REFUSED = "a password is required"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    # CT 202 is on the node too, but not in the rule (not a training container of this node's rule).
    f = Fleet(tmp_path_factory.mktemp("narrow-sudo"), nodes=1, containers=(200, 201, 202), gpus=6,
              node_user=USER, sudo_rule=NARROW_RULE)
    yield f
    f.down()


def sudo_pct(fleet, *args):
    return fleet.sim.ssh("pve1", " ".join(["sudo", "-n", "/usr/sbin/pct", *args]), user=USER)


def test_the_rule_grants_the_day_to_day_commands_and_refuses_the_rest(fleet):
    assert sudo_pct(fleet, "list").returncode == 0
    assert sudo_pct(fleet, "status", "200").stdout == "status: running\n"
    assert "dev0:" in sudo_pct(fleet, "config", "200").stdout
    assert sudo_pct(fleet, "exec", "200", "--", "id", "-u").stdout == "0\n"
    assert sudo_pct(fleet, "exec", "201", "--", "id", "-u").stdout == "0\n"  # the rule's second line
    # Root on the node, whatever the container: refused.
    for args in (("push", "200", "/etc/shadow", "/root/shadow"),
                 ("pull", "200", "/etc/hostname", "/etc/motd"), ("mount", "200"),
                 ("set", "200", "--mp0", "/,mp=/mnt/node"), ("destroy", "201"),
                 ("create", "300", "local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst"),
                 ("exec", "202", "--", "id", "-u"), ("exec", "2001", "--", "id", "-u"), ("status", "202"),
                 ("start", "200"),
                 ("status", "200", "--verbose")):
        res = sudo_pct(fleet, *args)
        assert res.returncode != 0 and REFUSED in res.stderr, (args, res)
    # Nothing else as root either.
    assert REFUSED in fleet.sim.ssh("pve1", "sudo -n id", user=USER).stderr


def test_deploy_restart_status_and_stop_under_the_narrow_rule(fleet):
    deploy = fleet.play("deploy.yml", "-l", "ct200")
    assert deploy.rc == 0, deploy
    first = fleet.run_info(200)
    assert first and fleet.alive(200, first["pid"])

    restart = fleet.play("restart_training.yml", "-l", "ct200")
    assert restart.rc == 0, restart
    second = fleet.run_info(200)
    assert second["pid"] != first["pid"] and fleet.alive(200, second["pid"])

    status = fleet.play("status.yml", "-l", "ct200")
    assert status.rc == 0, status
    table = next(iter(status.results("Show the fleet's runs.").values()))["msg"]
    row = next(line.split() for line in table[1:] if line.split()[0] == "ct200")
    assert row[3] == "running" and int(row[4]) == second["pid"], table

    stop = fleet.play("stop_training.yml", "-l", "ct200")
    assert stop.rc == 0, stop
    assert not fleet.alive(200, second["pid"]) and fleet.status(200)["state"] == "stopped"
