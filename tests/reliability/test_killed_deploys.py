"""deploy.yml killed at a random moment (SIGKILL to its whole process group) never leaves a
half-made state that the next deploy cannot repair.

Each trial changes the code (so the deploy must ship a new release and restart the run), starts
deploy.yml in its own process group, kills the group at a random time in [0, T] (T: the duration of
the first deploy, then of the last code-change deploy that finished before its kill was due),
waits until the tasks that were already running in the container have finished, then checks:
`current` points to a complete release (every file with the checksum of the controller's archive,
REVISION, a config that validates); exactly one of: the old run still running, a new run on the
live release, or no run because the old one was stopped cleanly (its SIGTERM checkpoint and stop
are in the log); never two runs holding the GPUs, never a run killed without its checkpoint.
Then deploy.yml runs again and must converge: rc 0, the new release live, the run on it, resumed
from the last checkpoint (first step = saved step + 1).
"""

from __future__ import annotations

import collections
import random
import time

import pytest

from pvesim.fleet import Fleet, change_code
from tests.reliability.deploy_faults_support import (
    RELEASES,
    VMID,
    Outcome,
    gpu_holders,
    group_members,
    kill_deploy_after,
    kill_deploy_when,
    kill_in_container,
    log_events,
    log_size,
    release_problems,
    validations_in_flight,
    wait_until_quiet,
)
from tests.reliability.trial_counts import trials
from tests.waiting import wait_for

# Under make test-reliability only: 2 x 2 min of randomised kills; make test keeps the all-or-nothing
# switch through test_bad_input.py's fast cases and tests/roles/test_release_tree.py.
pytestmark = [pytest.mark.sim, pytest.mark.slow, pytest.mark.reliability_full]

HEADER = "trial  kill at s  phase        after the kill  quiet s  converge s  last task"
ROW = "{:5}  {:9}  {:11}  {:14}  {:7}  {:10}  {}"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("killed-deploys"), nodes=1, containers=(VMID,))
    yield f
    f.down()


def first_stop(events: list[dict]) -> dict | None:
    return next((e for e in events if e["event"] == "stop"), None)


def after_kill(fleet, old: dict, offset: int) -> Outcome:
    """The state a killed deploy left, once the container is quiet, with what is wrong with it."""
    out = Outcome()
    current = fleet.live_release(VMID)
    out.violations += release_problems(fleet, current)
    info = fleet.run_info(VMID)
    live = info is not None and fleet.alive(VMID, info["pid"])
    old_left = group_members(fleet, old["pgid"])
    if live and info["pid"] == old["pid"]:
        out.state = "old running"
    else:
        out.state = "new running" if live else "stopped"
        if old_left:
            out.violations.append(f"the old run's group is alive ({old_left}) but not in the pidfile")
        stop = first_stop(log_events(fleet, offset=offset))
        if stop is None or stop.get("reason") != "signal SIGTERM":
            out.violations.append(f"the old run ended without a clean SIGTERM stop (its stop event: {stop})")
        else:
            out.saved_step = stop["step"]
        if live and info["argv"] != [f"{current}/run.sh"]:
            out.violations.append(f"the new run {info['argv']} is not on the live release {current}")
    holders = gpu_holders(fleet)
    if len(holders) != int(live):
        out.violations.append(f"GPU holders {sorted(holders)} with {int(live)} live run(s)")
    return out


def wait_for_first_step(fleet, pid: int, offset: int, timeout=180) -> list[dict]:
    """The log's events from `offset` once the run `pid` has logged its first step."""
    seen = []

    def stepped():
        seen[:] = log_events(fleet, offset=offset)
        start = next((i for i, e in enumerate(seen) if e["event"] == "start" and e.get("pid") == pid), None)
        return start is not None and any(e["event"] == "step" for e in seen[start:])

    assert wait_for(stepped, timeout, interval=2), f"run {pid} logged no step within {timeout} s: {seen[-5:]}"
    return list(seen)


def after_converge(fleet, old: dict, old_release: str, outcome: Outcome, offset: int) -> list[str]:
    """What is wrong after the deploy that followed the killed one."""
    problems = []
    live_release = fleet.live_release(VMID)
    problems += release_problems(fleet, live_release)
    if live_release == old_release:
        problems.append("the code change never became live")
    info = fleet.run_info(VMID)
    if info is None or not fleet.alive(VMID, info["pid"]):
        return [*problems, f"no live run after the deploy (pidfile {info})"]
    if info["argv"] != [f"{live_release}/run.sh"]:
        problems.append(f"the run {info['argv']} is not on the live release {live_release}")
    if info["pid"] == old["pid"] or group_members(fleet, old["pgid"]):
        problems.append("the old run is still alive")
    events = wait_for_first_step(fleet, info["pid"], offset)
    start = next(i for i, e in enumerate(events) if e["event"] == "start" and e.get("pid") == info["pid"])
    saves = [e["step"] for e in events[:start] if e["event"] == "checkpoint"]
    resume = events[start - 1] if start else {}
    first_step = next(e["step"] for e in events[start:] if e["event"] == "step")
    if resume.get("event") != "resume" or not saves or resume["step"] != saves[-1]:
        problems.append(f"the run did not resume from the last checkpoint (saves {saves}, then {resume})")
    elif outcome.saved_step is not None and resume["step"] != outcome.saved_step:
        problems.append(f"resumed at {resume['step']}, the stopped run saved {outcome.saved_step}")
    if not (resume.get("step", 0) > 0 and first_step == resume["step"] + 1):
        problems.append(f"first step {first_step} after resuming at {resume.get('step')}")
    if len(gpu_holders(fleet)) != 1:
        problems.append(f"GPU holders {sorted(gpu_holders(fleet))}")
    return problems


def test_a_killed_deploy_leaves_a_valid_release_and_one_run_and_the_next_deploy_converges(fleet, tmp_path):
    n = trials(1, 20)
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    started = time.monotonic()
    res = fleet.play("deploy.yml")
    assert res.rc == 0, res
    full_deploy_s = time.monotonic() - started

    rows, violations = [], []
    for i in range(n):
        where = f"trial {i} (seed {seed})"
        old, old_release, offset = fleet.run_info(VMID), fleet.live_release(VMID), log_size(fleet)
        assert old and fleet.alive(VMID, old["pid"]), where
        change_code(fleet.src, f"killed deploy {i}")
        killed = kill_deploy_after(fleet, rng.uniform(0, full_deploy_s), tmp_path / f"deploy-{i}.log")
        if not killed.killed:
            # It finished first: a whole deploy with a code change, the better measure of T.
            assert killed.returncode == 0, f"{where}: the deploy failed by itself:\n{killed.output[-3000:]}"
            full_deploy_s = killed.elapsed
        quiet_s = wait_until_quiet(fleet)
        outcome = after_kill(fleet, old, offset)
        violations += [f"{where}, killed in {killed.phase} ({killed.heading}): {v}"
                       for v in outcome.violations]

        converge_started = time.monotonic()
        res = fleet.play("deploy.yml")
        converge_s = time.monotonic() - converge_started
        assert res.rc == 0, f"{where}: the deploy after the kill did not converge: {res}"
        violations += [f"{where}, after converging: {v}"
                       for v in after_converge(fleet, old, old_release, outcome, offset)]
        rows.append((i, round(killed.delay, 1), killed.phase, outcome.state, round(quiet_s, 1),
                     round(converge_s, 1), killed.heading))
        print(ROW.format(*rows[-1]), flush=True)

    phases = collections.Counter(row[2] for row in rows)
    states = collections.Counter(row[3] for row in rows)
    print(f"\nkilled deploys: {n} trials, seed {seed}, full deploy {full_deploy_s:.1f} s, "
          f"{time.monotonic() - started:.0f} s in all")
    print(HEADER)
    for row in rows:
        print(ROW.format(*row))
    print(f"phases: {dict(phases)}; states: {dict(states)}; violations: {len(violations)}")
    assert not violations, "\n".join(violations)


# `make test` runs the harder case (the module killed too); the full suite runs both.
@pytest.mark.parametrize("module_too", [pytest.param(False, marks=pytest.mark.reliability_full), True],
                         ids=["controller", "controller-and-module"])
def test_a_deploy_killed_while_its_release_validates_switches_all_or_nothing(fleet, tmp_path, module_too):
    """The moment between a new release's unpack and its switch: the trainer validates the staged
    release. The deploy is killed as soon as that validation is seen (and, with `module_too`, the
    module and its validation in the container as well). Without the module killed, the module
    finishes in the container and the validated release goes live; with it, nothing goes live. Either
    way the old run keeps running on its release and the next deploy converges."""
    n = trials(1, 3)
    if fleet.run_info(VMID) is None:
        assert fleet.play("deploy.yml").rc == 0
    violations = []
    for i in range(n):
        where = f"trial {i}"
        old, old_release, offset = fleet.run_info(VMID), fleet.live_release(VMID), log_size(fleet)
        change_code(fleet.src, f"killed while validating {i} {module_too}")
        seen: list[int] = []

        def validating(_elapsed, seen=seen):
            seen.extend(validations_in_flight(fleet))
            return bool(seen)

        killed = kill_deploy_when(fleet, validating, tmp_path / f"validating-{module_too}-{i}.log")
        assert killed.killed, (f"{where}: the deploy ended before its release was validated:\n"
                               f"{killed.output[-3000:]}")
        in_container = kill_in_container(seen) if module_too else []
        wait_until_quiet(fleet)
        outcome = after_kill(fleet, old, offset)
        violations += [f"{where}, killed at {killed.elapsed:.1f} s: {v}" for v in outcome.violations]
        live = fleet.live_release(VMID)
        assert outcome.state == "old running", f"{where}: {outcome.state}"
        if module_too:
            assert in_container, f"{where}: the validation ended before it could be killed"
            assert live == old_release, f"{where}: {live} went live although its module was killed"
        else:
            assert live != old_release, f"{where}: the validated release did not go live"
        staged = fleet.ct(VMID, f"ls -a {RELEASES}").stdout.split()
        res = fleet.play("deploy.yml")
        assert res.rc == 0, f"{where}: the deploy after the kill did not converge: {res}"
        violations += [f"{where}, after converging: {v}"
                       for v in after_converge(fleet, old, old_release, outcome, offset)]
        # A staging directory the killed module left is gone once the next release is switched to.
        left = [d for d in fleet.ct(VMID, f"ls -a {RELEASES}").stdout.split() if d.startswith(".staging-")]
        assert not left, f"{where}: staging left after converging: {left} (after the kill: {staged})"
        print(f"killed while validating (module killed too: {module_too}): {where} at "
              f"{killed.elapsed:.1f} s, in the container killed {in_container}, live after the kill "
              f"{'the old release' if live == old_release else 'the new release'}, staging directories "
              f"after the kill {[d for d in staged if d.startswith('.staging-')]}", flush=True)
    assert not violations, "\n".join(violations)
