"""Stale and garbage pidfiles: none of them signals anything, each is reported, the start proceeds.

A pidfile may name a dead pid, a zombie, a pid now held by an unrelated process (another start
time), a dead pid whose recorded group is an unrelated live one; or it may be empty, truncated, not
JSON, or hold wrong fields. Each case keeps unrelated live processes next to it (a decoy in its own
session, the zombie's parent): they must survive every state of training_run, and a start must
bring up a new run. A pidfile writable by others is refused, and nothing is signalled or started.

The module is driven in a container directly (fast, every case); deploy.yml and
restart_training.yml meet the same cases under the full suite.
"""

import json
import shlex

import pytest

from tests.reliability.stops_support import (
    CONTAINERS,
    FAKE_RUN,
    PIDFILE,
    SLEEPER,
    ensure_runs,
    hosts,
    kill_sessions,
    live_run,
    make_zombie,
    process_table,
    results_with,
    spawn,
    still_there,
    training_run,
)
from tests.waiting import wait_for

# Under make test-reliability only: a fleet of its own (4 min); make test keeps the stale pidfile rules
# (a reused pid, a dead or zombie process, a start over a stale pidfile) through
# tests/modules/test_training_run_local.py.
pytestmark = [pytest.mark.sim, pytest.mark.slow, pytest.mark.reliability_full]


VMID = 200
NAME = "stale"
MODULE_PIDFILE = f"/var/lib/dflash/{NAME}.pid"
GARBAGE = ("empty", "truncated", "not-json", "wrong-fields")
CASES = ("dead", "zombie", "reused", "live-group", *GARBAGE)


def record(pid, pgid, start_time):
    return {"name": NAME, "pid": pid, "pgid": pgid, "start_time": start_time, "argv": [FAKE_RUN],
            "chdir": None, "log_path": f"/var/log/dflash/{NAME}.log",
            "started_at": "2026-01-01T00:00:00+00:00"}


def stale_pidfile(fleet, vmid, case):
    """Set up `case` in the container: (pidfile text, [(pid, start time)] that must survive, leaders of
    the sessions to end afterwards)."""
    [decoy] = spawn(fleet, vmid, [(["/usr/bin/python3", "-c", SLEEPER, FAKE_RUN], {})])
    survivors, sessions = [decoy], [decoy]
    if case == "dead" or case == "live-group":
        [gone] = spawn(fleet, vmid, [(["/bin/true"], {})])
        assert wait_for(lambda: not still_there(process_table(fleet, vmid), *gone), timeout=10)
        data = record(gone[0], gone[0], gone[1]) if case == "dead" else record(gone[0], decoy[0], decoy[1])
    elif case == "zombie":
        zombie, zombie_start, parent, parent_start = make_zombie(fleet, vmid)
        assert process_table(fleet, vmid)[zombie].state == "Z"
        # The zombie's group is its live parent's: signalling the recorded group would hit it.
        data = record(zombie, parent, zombie_start)
        survivors.append((parent, parent_start))
        sessions.append((parent, parent_start))
    elif case == "reused":
        data = record(decoy[0], decoy[0], decoy[1] - 7)
    else:
        data = None
    text = json.dumps(data) if data else {
        "empty": "",
        "truncated": json.dumps(record(decoy[0], decoy[0], decoy[1]))[:40],
        "not-json": f"pid={decoy[0]}\n",
        "wrong-fields": json.dumps({"pid": str(decoy[0]), "pgid": decoy[0], "start_time": "yesterday"}),
    }[case]
    return text, survivors, sessions


def write_pidfile(fleet, vmid, path, text):
    done = fleet.ct(vmid, f"mkdir -p /var/lib/dflash && printf %s {shlex.quote(text)} > {path}"
                    f" && chmod 644 {path} && rm -f {path}.unreadable-*")
    assert done.returncode == 0, done.stderr


def survivors_alive(fleet, vmid, survivors):
    table = process_table(fleet, vmid)
    return [pid for pid, start in survivors if not still_there(table, pid, start)]


def moved_aside(fleet, vmid, path):
    return fleet.ct(vmid, f"ls {path}.unreadable-* 2>/dev/null").stdout.split()


@pytest.mark.parametrize("case", CASES)
def test_stale_pidfile_signals_nothing_is_reported_and_the_start_proceeds(fleet, case):
    start_state = "restarted" if CASES.index(case) % 2 else "started"
    sessions, new_run = [], None
    try:
        text, survivors, leaders = stale_pidfile(fleet, VMID, case)
        sessions += leaders
        write_pidfile(fleet, VMID, MODULE_PIDFILE, text)

        status = training_run(fleet, VMID, name=NAME, state="status")
        assert not status.get("failed"), status
        assert status["status"] == "stopped" and status["stale_pidfile"] is True, status
        if case in GARBAGE:
            assert status.get("pidfile_problem"), status

        stopped = training_run(fleet, VMID, name=NAME, state="stopped", stop_timeout=5)
        assert not stopped.get("failed"), stopped
        assert stopped.get("signalled", []) == [] and stopped["status"] == "stopped", stopped
        assert fleet.read(VMID, MODULE_PIDFILE) is None
        if case in GARBAGE:
            assert moved_aside(fleet, VMID, MODULE_PIDFILE), "the garbage pidfile was not moved aside"
            assert "unreadable" in stopped["msg"] or MODULE_PIDFILE in stopped["msg"], stopped
        assert survivors_alive(fleet, VMID, survivors) == [], f"{case}: stop signalled an unrelated process"

        write_pidfile(fleet, VMID, MODULE_PIDFILE, text)
        started = training_run(fleet, VMID, name=NAME, state=start_state, stop_timeout=5,
                               command=["/usr/bin/python3", FAKE_RUN])
        assert not started.get("failed"), started
        new_run = started.get("run")
        assert started["status"] == "running" and started["changed"] is True, started
        assert started["stale_pidfile"] is True or "unreadable" in started["msg"], started
        assert started.get("signalled", []) == [], started
        table = process_table(fleet, VMID)
        assert still_there(table, new_run["pid"], new_run["start_time"])
        assert new_run["pid"] not in [pid for pid, _ in survivors]
        assert json.loads(fleet.read(VMID, MODULE_PIDFILE))["pid"] == new_run["pid"]
        assert survivors_alive(fleet, VMID, survivors) == [], f"{case}: start signalled an unrelated process"
        print(f"stale pidfile ({case}): status reported it, stop and {start_state} signalled nothing, "
              f"new run {new_run['pid']}, {len(survivors)} unrelated process(es) alive")
    finally:
        if new_run:
            training_run(fleet, VMID, name=NAME, state="stopped", stop_timeout=5)
        kill_sessions(fleet, VMID, sessions)
        fleet.ct(VMID, f"rm -f {MODULE_PIDFILE} {MODULE_PIDFILE}.unreadable-*")


def test_pidfile_writable_by_others_is_refused_and_nothing_is_touched(fleet):
    name = "writable"
    pidfile = f"/var/lib/dflash/{name}.pid"
    command = ["/usr/bin/python3", FAKE_RUN, "--ready", f"/tmp/stops-{name}-ready"]
    run = training_run(fleet, VMID, name=name, state="started", command=command)
    assert not run.get("failed"), run
    run = run["run"]
    try:
        # What the message must say: the mode, or that the owner is not the module's user.
        for mode, owner, says in (("666", "root", "666"), ("620", "root", "620"), ("644", "nobody", "own")):
            assert fleet.ct(VMID, f"chmod {mode} {pidfile} && chown {owner} {pidfile}").returncode == 0
            status = training_run(fleet, VMID, name=name, state="status")
            assert not status.get("failed"), status
            assert says in status.get("pidfile_unsafe", ""), status
            for state in ("stopped", "restarted", "started"):
                refused = training_run(fleet, VMID, name=name, state=state, stop_timeout=5, command=command)
                assert refused.get("failed") is True, (mode, owner, state, refused)
                assert pidfile in refused["msg"] and says in refused["msg"], refused
                assert refused.get("signalled", []) == [], refused
                table = process_table(fleet, VMID)
                runs = [p.pid for p in table.values() if p.alive and list(p.argv) == command]
                assert runs == [run["pid"]], (mode, owner, state, runs)
                assert still_there(table, run["pid"], run["start_time"]), (mode, owner, state)
            print(f"pidfile mode {mode} owner {owner}: status reports it; stopped, restarted and started "
                  f"refused ({refused['msg'][:120]}); the run lives")
        assert fleet.ct(VMID, f"chmod 644 {pidfile} && chown root {pidfile}").returncode == 0
        stopped = training_run(fleet, VMID, name=name, state="stopped", stop_timeout=5)
        assert not stopped.get("failed") and stopped["how"] == "terminated", stopped
    finally:
        kill_sessions(fleet, VMID, [(run["pid"], run["start_time"])])
        fleet.ct(VMID, f"rm -f {pidfile}")


@pytest.mark.reliability_full
def test_deploy_starts_over_every_stale_pidfile_and_restart_refuses_a_writable_one(fleet):
    ensure_runs(fleet, CONTAINERS, live=False)
    sessions = {}
    try:
        for batch in (CASES[i:i + len(CONTAINERS)] for i in range(0, len(CASES), len(CONTAINERS))):
            placed = dict(zip(CONTAINERS, batch, strict=False))
            survivors = {}
            for vmid, case in placed.items():
                text, survivors[vmid], leaders = stale_pidfile(fleet, vmid, case)
                sessions.setdefault(vmid, []).extend(leaders)
                write_pidfile(fleet, vmid, PIDFILE, text)
            play = fleet.play("deploy.yml", "-l", hosts(placed), "-e", f"dflash_fleet_serial={len(placed)}",
                              timeout=1800)
            assert play.rc == 0, play
            for vmid, case in placed.items():
                host = f"ct{vmid}"
                reported = [r for r in results_with(play, host, "stale_pidfile")
                            if r["stale_pidfile"] is True or "unreadable" in str(r.get("msg"))]
                assert reported, f"{case}: the deploy did not report the stale pidfile"
                assert all(r.get("signalled", []) == [] for r in results_with(play, host, "signalled")), case
                assert live_run(fleet, vmid), f"{case}: no live run after the deploy"
                assert survivors_alive(fleet, vmid, survivors[vmid]) == [], f"{case}: a decoy died"
                print(f"deploy.yml over a stale pidfile ({case}): reported, nothing signalled, run started")
            ensure_runs(fleet, list(placed), live=False)

        ensure_runs(fleet, [VMID], live=True)
        before = live_run(fleet, VMID)
        assert fleet.ct(VMID, f"chmod 666 {PIDFILE}").returncode == 0
        play = fleet.play("restart_training.yml", "-l", f"ct{VMID}", timeout=1800)
        assert play.rc != 0 and PIDFILE in play.messages(), play
        assert live_run(fleet, VMID) == before, "the run changed under a refused pidfile"
        print(f"restart_training.yml with a world-writable pidfile: refused ({play.messages()[:160]})")
    finally:
        fleet.ct(VMID, f"chmod 644 {PIDFILE}")
        for vmid, leaders in sessions.items():
            kill_sessions(fleet, vmid, leaders)
