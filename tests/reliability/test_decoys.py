"""Decoys: stop_training.yml and restart_training.yml stop exactly the run and all of it.

Each round puts a random set of decoys into every container: processes whose command lines hold
what `pkill -f` would match (run.sh, the release path, the log path, the trainer's module name),
in their own sessions, as an operator's shells, `tail -f` and editors are. Then one playbook, picked
at random, runs on all containers at once: each container is one trial. Every decoy must be alive
with its start time afterwards, and every process of the old run's group (and its descendants)
gone.
"""

import json
import math
from dataclasses import dataclass, field

import pytest

from tests.reliability.stops_support import (
    CONTAINERS,
    LOG,
    PIDFILE,
    RUN_GPUS,
    SLEEPER,
    VENV_PYTHON,
    ensure_runs,
    gpu_memory,
    hosts,
    kill_sessions,
    process_table,
    rng_for,
    run_group,
    spawn,
    still_there,
    training_run,
)
from tests.reliability.trial_counts import trials

# Under make test-reliability only: 4 min of randomised trials; make test keeps the decoy rule
# through tests/modules/test_training_run_local.py (a decoy naming the run's script survives a stop)
# and tests/pvesim/test_pkill_trap.py.
pytestmark = [pytest.mark.sim, pytest.mark.slow, pytest.mark.reliability_full]


KINDS = ("connection shell", "tail -f of the log", "editor on run.sh", "trainer's name", "second run")
SECOND_RUN_GPU = 3  # a second run of another name, on a GPU of its own


@dataclass
class Decoy:
    kind: str
    pid: int
    start_time: int
    argv: tuple = ()
    files: tuple = ()  # a second run's own pidfile, lock and log


@dataclass
class Trial:
    vmid: int
    playbook: str
    old_run: dict | None
    old_group: dict
    decoys: list = field(default_factory=list)


def decoy_commands(kind, current, release, rng):
    """(argv, environment) of one decoy; every argv holds a string `pkill -f` would match."""
    script = rng.choice([f"{current}/run.sh", f"{release}/run.sh"])
    if kind == "connection shell":  # what `pct exec ... sh -c '...'` leaves while it waits
        return ["/bin/sh", "-c", f"sleep 3600; : {script}"], {}
    if kind == "tail -f of the log":
        return ["tail", "-f", LOG], {}
    if kind == "editor on run.sh":
        return ["/usr/bin/python3", "-c", SLEEPER, "vim", script], {}
    if kind == "trainer's name":
        return ["/usr/bin/python3", "-c", SLEEPER, "-m", "dflash_ops.train", "dflash_ops/train.py",
                "--config", f"{release}/config.yaml"], {}
    raise ValueError(kind)


def start_decoys(fleet, trial, rng, serial):
    """A random, non-empty set of decoys in the trial's container."""
    current = "/opt/dflash/current"
    release = fleet.live_release(trial.vmid)
    kinds = rng.sample(KINDS, rng.randint(2, len(KINDS)))
    plain = [k for k in kinds if k != "second run"]
    for kind, (pid, start) in zip(plain, spawn(fleet, trial.vmid, [decoy_commands(k, current, release, rng)
                                                                   for k in plain]), strict=True):
        trial.decoys.append(Decoy(kind, pid, start))
    if "second run" in kinds:
        name = f"decoy{serial}"
        started = training_run(fleet, trial.vmid, name=name, state="started", startup_wait=0.5,
                               command=[VENV_PYTHON, "-c", SLEEPER, f"{release}/run.sh"],
                               environment={"CUDA_VISIBLE_DEVICES": str(SECOND_RUN_GPU)})
        assert not started.get("failed"), started
        own = (started["pidfile"], started["pidfile"] + ".lock", started["run"]["log_path"])
        trial.decoys.append(Decoy("second run", started["pid"], started["run"]["start_time"], files=own))
    table = process_table(fleet, trial.vmid)
    for decoy in trial.decoys:
        assert still_there(table, decoy.pid, decoy.start_time), decoy
        decoy.argv = table[decoy.pid].argv
        # The decoy is one that a name pattern would hit.
        assert any(s in " ".join(decoy.argv) for s in ("run.sh", LOG, "dflash_ops.train")), decoy


def check_trial(fleet, trial, play):
    """(decoys killed, runs left behind, problems) of one trial after its playbook."""
    table = process_table(fleet, trial.vmid)
    problems = []
    killed = [d for d in trial.decoys if not still_there(table, d.pid, d.start_time)]
    problems += [f"CT {trial.vmid}: decoy {d.kind} (pid {d.pid}, {' '.join(d.argv)}) was killed"
                 for d in killed]
    left = {pid: start for pid, start in trial.old_group.items() if still_there(table, pid, start)}
    if trial.old_run is not None:
        pgid = trial.old_run["pgid"]
        left.update({p.pid: p.start_time for p in table.values() if p.pgid == pgid and p.alive})
    if left:
        problems.append(f"CT {trial.vmid}: processes of the old run are left: {sorted(left)}")
    text = fleet.read(trial.vmid, PIDFILE)
    if trial.playbook == "restart_training.yml":
        new = json.loads(text) if text else None
        if not new or not still_there(table, new["pid"], new["start_time"]):
            problems.append(f"CT {trial.vmid}: no live run after the restart (pidfile {text!r})")
        elif trial.old_run is not None and new["pid"] == trial.old_run["pid"]:
            problems.append(f"CT {trial.vmid}: the restart kept the old run {new['pid']}")
    else:
        if text:
            problems.append(f"CT {trial.vmid}: the pidfile is left after the stop: {text!r}")
        memory = gpu_memory(fleet, trial.vmid)
        busy = [i for i in RUN_GPUS if memory[i] > 0]
        if busy:
            problems.append(f"CT {trial.vmid}: GPUs {busy} still busy after the stop: {memory}")
        second_runs = [d for d in trial.decoys if d.kind == "second run" and d not in killed]
        if second_runs and memory[SECOND_RUN_GPU] == 0:
            problems.append(f"CT {trial.vmid}: the second run's GPU {SECOND_RUN_GPU} is idle: {memory}")
    return len(killed), int(bool(left)), problems


def end_decoys(fleet, trial):
    kill_sessions(fleet, trial.vmid, [(d.pid, d.start_time) for d in trial.decoys])
    files = [path for d in trial.decoys for path in d.files]
    if files:
        fleet.ct(trial.vmid, "rm -f " + " ".join(files))


def playbooks_for(rounds, rng):
    """A random order of the two playbooks; after a stop comes a restart (there is nothing left to
    stop), and both occur when there are two rounds or more."""
    order, previous = [], None
    for _ in range(rounds):
        previous = "restart_training.yml" if previous == "stop_training.yml" else rng.choice(
            ["stop_training.yml", "restart_training.yml"])
        order.append(previous)
    if rounds >= 2 and "stop_training.yml" not in order:
        order[-1] = "stop_training.yml"
    return order


def test_stops_and_restarts_spare_every_decoy_and_leave_nothing_of_the_run(fleet):
    rng, seed = rng_for("decoys")
    rounds = math.ceil(trials(8, 52) / len(CONTAINERS))
    ensure_runs(fleet, CONTAINERS, live=True)
    totals = dict(trials=0, decoys=0, killed=0, left=0)
    outcomes, problems, serial = {"stop_training.yml": 0, "restart_training.yml": 0}, [], 0
    for playbook in playbooks_for(rounds, rng):
        round_trials = []
        for vmid in CONTAINERS:
            table = process_table(fleet, vmid)
            record = fleet.run_info(vmid)
            group = run_group(table, record) if record else {}
            trial = Trial(vmid, playbook, record, group)
            serial += 1
            start_decoys(fleet, trial, rng, serial)
            round_trials.append(trial)
        try:
            args = ["-e", f"dflash_fleet_serial={len(CONTAINERS)}"] if playbook.startswith("restart") else []
            play = fleet.play(playbook, "-l", hosts(CONTAINERS), *args, timeout=1800)
            assert play.rc == 0, play
            for trial in round_trials:
                killed, left, found = check_trial(fleet, trial, play)
                totals["trials"] += 1
                totals["decoys"] += len(trial.decoys)
                totals["killed"] += killed
                totals["left"] += left
                outcomes[playbook] += 1
                problems += found
        finally:
            for trial in round_trials:
                end_decoys(fleet, trial)
    print(f"decoys: {totals['trials']} trials ({outcomes['stop_training.yml']} stop_training, "
          f"{outcomes['restart_training.yml']} restart_training), {totals['decoys']} decoys, "
          f"decoys killed: {totals['killed']}, runs left behind: {totals['left']} (seed {seed})")
    assert totals["killed"] == 0 and totals["left"] == 0, "\n".join(problems)
    assert not problems, "\n".join(problems)
