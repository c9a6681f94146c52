"""deploy.yml, restart_training.yml, stop/status/rollback and fleet rollout against a 2-node pvesim.

The tests of this module share one fleet and, run in order, each starts from the state the previous
one left (like an operator's day). Each also makes the state it needs when run alone (`ensure_running`,
`ensure_died`, `ensure_previous_release`: nothing to do in order). pve1 has CT 200 and 201, pve2 has
CT 202 and 203.
"""

import json
import re
from pathlib import Path

import pytest

from pvesim.fleet import REPO, Fleet, change_code
from tests.waiting import wait_for

pytestmark = [pytest.mark.sim, pytest.mark.slow]

CONTAINERS = (200, 201, 202, 203)
HOSTS = [f"ct{v}" for v in CONTAINERS]
# The start, or a restart's stop, idle check and start, in one call.
RESTART_TASK = "Wait for the restart's call (its stop, the GPUs' idle wait, the start), saying what it does."


# docs/CONTRACTS.md's table of the round trips into a container that a play may make: {play: count}.
CONTAINER_TASKS = {row[0]: int(row[1]) for row in re.findall(
    r"^\| `([a-z_]+\.yml)`[^|]*\| (\d+) \|$", (REPO / "docs" / "CONTRACTS.md").read_text(), re.MULTILINE)}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("roles-fleet"), nodes=2, containers=CONTAINERS)
    yield f
    f.down()




def running(fleet, vmid):
    info = fleet.run_info(vmid)
    return bool(info) and fleet.alive(vmid, info["pid"])


def ensure_running(fleet, *vmids):
    """The containers run a deployed release: the first test's deploy, or one made now."""
    missing = [f"ct{v}" for v in vmids or CONTAINERS if not running(fleet, v)]
    if missing:
        res = fleet.play("deploy.yml", "-e", "dflash_fleet_serial=4", "-l", ",".join(missing))
        assert res.rc == 0, res


def ensure_died(fleet, vmid):
    """The container's run was killed without a stop, its process group SIGKILLed as an OOM kill would.
    (A container stopped and started again starts such a run again at its boot: dflash-resume.)"""
    if not fleet.run_info(vmid):
        ensure_running(fleet, vmid)
    if running(fleet, vmid):
        run = fleet.run_info(vmid)
        assert fleet.ct(vmid, f"kill -KILL -{run['pgid']}").returncode == 0
        assert wait_for(lambda: not fleet.alive(vmid, run["pid"]), timeout=30)


def ensure_previous_release(fleet, vmid):
    """The container has a previous release to go back to, as the restart test leaves CT 201."""
    ensure_running(fleet, vmid)
    if fleet.ct(vmid, "test -L /opt/dflash/previous").returncode != 0:
        change_code(fleet.src, "previous")
        res = fleet.play("restart_training.yml", "-l", f"ct{vmid}")
        assert res.rc == 0, res


def container_checksums(fleet, vmid, release_dir):
    find = f"cd {release_dir} && find . -type f ! -path '*/__pycache__/*' -exec sha256sum {{}} +"
    out = fleet.ct(vmid, find).stdout
    return {line.split(None, 1)[1].strip()[2:]: line.split()[0] for line in out.splitlines()}


def pids(fleet):
    return {v: (fleet.run_info(v) or {}).get("pid") for v in CONTAINERS}


def test_deploy_ships_the_release_into_each_container_and_starts_the_run(fleet):
    res = fleet.play("deploy.yml", "-e", "dflash_fleet_serial=4")
    assert res.rc == 0, res
    # The node checks of the batch are one task for all four containers on both nodes (not one run
    # per node), each container checked on its own node with its GPUs.
    checks = [task.hosts for task in res.tasks
              if task.name.startswith("Check the container on its Proxmox node")]
    assert len(checks) == 1 and set(checks[0]) == set(HOSTS), checks
    for host, result in checks[0].items():
        node = fleet.sim.node_of(int(host[2:])).name
        assert result["msg"].startswith(f"CT {host[2:]} on node {node}: running"), result
        assert result["gpu_count"] == 4 and result["gpu_passthrough"], result
    for vmid in CONTAINERS:
        release_dir = fleet.live_release(vmid)
        release_id = Path(release_dir).name
        assert release_dir == f"/opt/dflash/releases/{release_id}"
        # Every file of the release is in the container with the checksum it has on the controller.
        expected = fleet.release_files(release_id)
        assert "config.yaml" in expected and "run.sh" in expected and "dflash_ops/train.py" in expected
        assert container_checksums(fleet, vmid, release_dir) == expected
        assert f"release: {release_id}" in fleet.read(vmid, f"{release_dir}/REVISION")
        # The run was started from that release and is alive.
        info = fleet.run_info(vmid)
        assert info["argv"] == [f"{release_dir}/run.sh"]
        assert fleet.alive(vmid, info["pid"])
        environ = fleet.ct(vmid, f"tr '\\0' '\\n' < /proc/{info['pid']}/environ").stdout.splitlines()
        assert f"PYTHONPATH={release_dir}" in environ
    # Nothing of the release is on the nodes (the nodes' filesystem is this machine's).
    for node in ("pve1", "pve2"):
        assert fleet.sim.ssh(node, "test -e /opt/dflash").returncode == 1
    assert not Path("/opt/dflash").exists()
    # gpu_verify (run by the playbook after the start) saw the run's GPUs busy.
    busy = res.results("Wait until the run's GPUs are busy.")
    assert set(busy) == set(HOSTS)
    for result in busy.values():
        assert {g["index"] for g in result["gpus"] if g["memory_used_mib"] > 0} >= {0, 1}
        assert result["processes"]


def test_second_deploy_changes_nothing_and_keeps_the_runs(fleet):
    ensure_running(fleet)
    before = pids(fleet)
    res = fleet.play("deploy.yml", "-e", "dflash_fleet_serial=4")
    assert res.rc == 0, res
    assert {h: s["changed"] for h, s in res.stats.items() if h in HOSTS} == {h: 0 for h in HOSTS}
    assert pids(fleet) == before
    # No more round trips into a container than the docs state (a new task must say so there).
    for host in HOSTS:
        tasks = [task.name for task in res.connected_tasks(host)]
        assert 0 < len(tasks) <= CONTAINER_TASKS["deploy.yml"], (host, tasks)


def test_restart_training_with_limit_restarts_only_that_container_and_resumes(fleet):
    ensure_running(fleet)
    before = {v: fleet.run_info(v) for v in CONTAINERS}
    releases = {v: fleet.live_release(v) for v in CONTAINERS}
    checkpoint = fleet.wait_for_checkpoint(201)
    change_code(fleet.src, "restart")

    res = fleet.play("restart_training.yml", "-l", "ct201")
    assert res.rc == 0, res
    assert set(res.stats) <= {"ct201", "localhost"}

    # The old run is gone, its whole process group with it.
    old = before[201]
    assert not fleet.alive(201, old["pid"])
    group = fleet.ct(201, f"ps -o pid= -g {old['pgid']}").stdout.split()
    assert group == [], f"processes of the old run's group are left: {group}"
    # The GPUs were idle between the stop and the start: the restart's one call checked them after the stop.
    restart = res.results(RESTART_TASK)["ct201"]
    assert restart["previous_pid"] == before[201]["pid"] and restart["how"] == "terminated", restart
    # No more round trips into the container than the docs state; the boot unit is in the restart's call.
    tasks = [task.name for task in res.connected_tasks("ct201")]
    assert RESTART_TASK in tasks and len(tasks) <= CONTAINER_TASKS["restart_training.yml"], tasks
    assert restart["boot"]["start_file"] == "/var/lib/dflash/main.boot.json", restart
    idle = restart["gpu_idle"]
    assert idle["met"] and not [p for p in idle["processes"] if p["gpu_index"] in (0, 1)], idle
    # The new run runs the new release and resumed from the old run's checkpoint.
    new = fleet.run_info(201)
    assert new["pid"] != old["pid"]
    new_release = fleet.live_release(201)
    assert new_release != releases[201]
    assert new["argv"] == [f"{new_release}/run.sh"]
    events = [json.loads(line) for line in fleet.read(201, "/var/log/dflash/main.log").splitlines()
              if line.startswith("{")]
    start = next(i for i, e in enumerate(events) if e["event"] == "start" and e.get("pid") == new["pid"])
    resume = events[start - 1]
    last_save = [e for e in events[:start] if e["event"] == "checkpoint"][-1]
    assert resume["event"] == "resume" and resume["step"] == last_save["step"] == events[start]["step"]
    assert resume["step"] >= checkpoint["step"] > 0
    # -l ct201: the other containers kept their run and their release.
    for vmid in (200, 202, 203):
        assert fleet.run_info(vmid)["pid"] == before[vmid]["pid"]
        assert fleet.live_release(vmid) == releases[vmid]


def test_restart_refuses_to_stop_a_healthy_run_for_a_config_that_does_not_validate(fleet):
    ensure_running(fleet, 202)
    before = fleet.run_info(202)
    release = fleet.live_release(202)
    bad = '{"dflash_release_settings": {"model": {"block_size": 1}}}'
    res = fleet.play("restart_training.yml", "-l", "ct202", "-e", bad)
    assert res.rc != 0
    assert "does not validate" in res.messages() and "block_size" in res.messages()
    assert fleet.run_info(202)["pid"] == before["pid"] and fleet.alive(202, before["pid"])
    assert fleet.live_release(202) == release


def test_a_failed_container_stops_the_rollout_and_leaves_the_rest_as_they_were(fleet):
    ensure_running(fleet)
    before = pids(fleet)
    releases = {v: fleet.live_release(v) for v in CONTAINERS}
    assert fleet.sim.ssh("pve1", "pct stop 200").returncode == 0
    try:
        change_code(fleet.src, "fleet")
        # Default rollout: ct200 alone first, then the rest; ct200 fails, so the rest is never started.
        res = fleet.play("deploy.yml")
        assert res.rc != 0
        assert "CT 200 on node pve1 is not running" in res.messages()
        assert "ct200 (CT 200 on pve1) failed at" in res.messages()
        for vmid in (201, 202, 203):
            assert fleet.live_release(vmid) == releases[vmid]
            assert fleet.run_info(vmid)["pid"] == before[vmid] and fleet.alive(vmid, before[vmid])
    finally:
        fleet.start_container(200)  # its boot starts the run again (dflash-resume)


# Under make test-reliability only (half a minute): make test keeps the table's rendering
# (test_status_table.py) and a status through the playbook (test_example_inventory.py).
@pytest.mark.reliability_full
def test_status_shows_one_table_for_the_fleet(fleet):
    ensure_running(fleet, 201, 202, 203)
    ensure_died(fleet, 200)
    res = fleet.play("status.yml")
    assert res.rc == 0, res
    table = next(iter(res.results("Show the fleet's runs.").values()))["msg"]
    assert table[0].split()[:4] == ["container", "node", "release", "state"]
    rows = {line.split()[0]: line.split() for line in table[1:] if not line.startswith(" ")}
    assert set(rows) == set(HOSTS)
    for vmid in (201, 202, 203):
        row = rows[f"ct{vmid}"]
        assert row[1] == ("pve1" if vmid < 202 else "pve2")
        assert row[2] == Path(fleet.live_release(vmid)).name
        assert row[3] == "running" and int(row[4]) == fleet.run_info(vmid)["pid"]
        assert int(row[5]) >= 1 and "0:" in " ".join(row[11:]) and "1:" in " ".join(row[11:])
    # CT 200's run was killed without a stop, so the table says it died (not stopped), with its last
    # step and checkpoint, and the end of its log.
    status = fleet.status(200)
    assert status["state"] in ("starting", "running", "stopping")  # what the killed run last wrote
    died = rows["ct200"]
    assert died[3] == "died" and died[4] == "-" and died[5] == str(status["step"])
    checkpoint = status["last_checkpoint"]
    assert died[10] == (str(int(Path(checkpoint).name[5:])) if checkpoint else "-")
    after = table[table.index(next(line for line in table if line.startswith("ct200"))) + 1:]
    assert after and after[0].lstrip().startswith("log: {")


def test_rollback_goes_back_to_the_previous_release_and_restarts(fleet):
    ensure_previous_release(fleet, 201)
    new_release = fleet.live_release(201)
    before = fleet.run_info(201)
    res = fleet.play("rollback.yml", "-l", "ct201")
    assert res.rc == 0, res
    back = fleet.live_release(201)
    assert back != new_release
    assert fleet.ct(201, "readlink /opt/dflash/previous").stdout.strip() == new_release
    info = fleet.run_info(201)
    assert info["pid"] != before["pid"] and info["argv"] == [f"{back}/run.sh"]


# Under make test-reliability only (1.5 min: a restart at -vvv): make test keeps the same checks on the
# first deploy with a secret (test_example_inventory.py).
@pytest.mark.reliability_full
def test_secrets_reach_the_run_and_nothing_else(fleet):
    ensure_running(fleet, 203)
    token = "hf_test_token_5d41402abc4b2a76"
    secrets = json.dumps({"dflash_run_secret_environment": {"HF_TOKEN": token}})
    res = fleet.play("restart_training.yml", "-l", "ct203", "-e", secrets, "-vvv")
    assert res.rc == 0, res
    status = fleet.play("status.yml", "-l", "ct203", "-vvv")
    assert status.rc == 0, status
    pid = fleet.run_info(203)["pid"]
    # The run has it in its environment...
    environ = fleet.ct(203, f"tr '\\0' '\\n' < /proc/{pid}/environ").stdout.splitlines()
    assert f"HF_TOKEN={token}" in environ
    # ...from a file only root can read...
    assert fleet.ct(203, "stat -c '%a %U' /var/lib/dflash/secrets/main.env").stdout.split() == ["600", "root"]
    # ...and it is nowhere else: not in Ansible's output (even -vvv), the status table, the run's
    # log, its pidfile, its status.json or the release.
    for output in (res.stdout, res.stderr, status.stdout, status.stderr):
        assert token not in output
    leaks = fleet.ct(203, f"grep -rl {token} /var/log/dflash /opt/dflash /var/lib/dflash/main.pid "
                          "/var/lib/dflash/runs").stdout.split()
    assert leaks == []


# Under make test-reliability only (half a minute): make test keeps a stop with its checkpoint through
# the playbook in test_example_inventory.py and test_narrow_sudo.py.
@pytest.mark.reliability_full
def test_stop_training_checkpoints_and_frees_the_gpus(fleet):
    ensure_running(fleet, 202)
    before = fleet.run_info(202)
    res = fleet.play("stop_training.yml", "-l", "ct202")
    assert res.rc == 0, res
    assert not fleet.alive(202, before["pid"])
    status = fleet.status(202)
    assert status["state"] == "stopped" and status["last_checkpoint"]
    assert res.results("Stop the run (the trainer checkpoints on SIGTERM).")["ct202"]["how"] == "terminated"
    # A stopped run is shown as stopped (its pidfile is gone), not as one that died.
    shown = fleet.play("status.yml", "-l", "ct202").results("Show the fleet's runs.")
    table = next(iter(shown.values()))["msg"]
    assert table[1].split()[:4] == ["ct202", "pve2", Path(fleet.live_release(202)).name, "stopped"]
