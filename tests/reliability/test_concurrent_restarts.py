"""Two restart_training.yml at once on one container: never two runs, and one run at the end.

While both playbooks run, a sampler inside the container records every 0.2 s the live runs (process
groups led by run.sh or the trainer) and every second the sim's nvidia-smi. At no sample may two
runs live, nor two processes hold one GPU; at the end exactly one run lives, the one the pidfile
names. Each playbook either succeeds or fails saying that another deploy changed the run.
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.reliability.stops_support import (
    PIDFILE,
    PROC_ENTRIES,
    ensure_runs,
    is_run,
    kill_sessions,
    process_table,
    rng_for,
    spawn,
    still_there,
)
from tests.reliability.trial_counts import trials

# Under make test-reliability only: 4 min of randomised trials; make test keeps the run's lock through
# the training_run tests (a restart waits for another deploy's lock, then acts on the run as it is,
# tests/modules/test_training_run_files.py) and test_start_waits_for_idle_gpus.py.
pytestmark = [pytest.mark.sim, pytest.mark.slow, pytest.mark.reliability_full]


VMID = 203
SAMPLES = "/tmp/stops-concurrent-samples.jsonl"

# argv: the samples file. One JSON line per sample: live runs {pid: start time}, and from nvidia-smi
# (about once a second) the compute apps [pid, gpu uuid]. Run in its own session; ended by pid.
SAMPLER = PROC_ENTRIES + r"""
import json, subprocess, sys, time
def runs():
    found = {}
    for pid, f, argv in proc_entries():
        as_run = any(a.endswith("/run.sh") for a in argv[:2])
        trainer = any(a == "-m" and b == "dflash_ops.train" for a, b in zip(argv, argv[1:]))
        if f[0] not in "ZX" and int(f[2]) == pid and (as_run or trainer):
            found[str(pid)] = int(f[19])
    return found
last_smi = 0.0
with open(sys.argv[1], "w") as out:
    while True:
        sample = {"t": time.time(), "runs": runs()}
        if time.monotonic() - last_smi >= 1.0:
            last_smi = time.monotonic()
            smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                                 capture_output=True, text=True)
            sample["gpu_apps"] = [line.split(", ") for line in smi.stdout.splitlines() if line.strip()]
        out.write(json.dumps(sample) + "\n")
        out.flush()
        time.sleep(0.2)
"""


def clear_outcome(play):
    """'ok', or the failure message when it says that another deploy changed the run, else None."""
    if play.rc == 0:
        return "ok"
    messages = play.messages()
    return messages if "another deploy" in messages else None


def overlaps(samples):
    """Samples with two runs at once, or a GPU held by two processes."""
    bad = []
    for sample in samples:
        if len(sample["runs"]) > 1:
            bad.append(f"{sample['t']:.1f}: two runs {sample['runs']}")
        holders = {}
        for pid, uuid in sample.get("gpu_apps", []):
            holders.setdefault(uuid, set()).add(pid)
        bad += [f"{sample['t']:.1f}: GPU {uuid} held by {sorted(pids)}" for uuid, pids in holders.items()
                if len(pids) > 1]
    return bad


def test_two_restarts_at_once_leave_one_run_and_never_two(fleet):
    rng, seed = rng_for("concurrent restarts")
    ensure_runs(fleet, [VMID], live=True)
    count = trials(1, 30)
    # The second playbook starts 0 to 5 s after the first, spread evenly over that range (one offset drawn
    # in each of `count` equal slices): the first one's inventory checks, its stop, its wait for idle GPUs
    # and its start all fall in it, so the later play inspects the run in every phase of the earlier one.
    offsets = [round(5.0 * (i + rng.random()) / count, 1) for i in range(count)]
    rng.shuffle(offsets)
    tally, problems = {"ok": 0, "clear": 0, "unclear": 0}, []
    for number, offset in enumerate(offsets, 1):
        before = fleet.run_info(VMID)
        sampler = spawn(fleet, VMID, [(["/usr/bin/python3", "-c", SAMPLER, SAMPLES], {})])
        try:
            with ThreadPoolExecutor(2) as pool:
                first = pool.submit(fleet.play, "restart_training.yml", "-l", f"ct{VMID}", timeout=1800)
                time.sleep(offset)
                second = pool.submit(fleet.play, "restart_training.yml", "-l", f"ct{VMID}", timeout=1800)
                plays = [first.result(), second.result()]
            time.sleep(1.0)  # a last sample after both ended
        finally:
            kill_sessions(fleet, VMID, sampler)
        text = fleet.read(VMID, SAMPLES) or ""
        samples = [json.loads(line) for line in text.splitlines() if line.strip()]
        table = process_table(fleet, VMID)
        runs = [p for p in table.values() if is_run(p)]
        record = json.loads(fleet.read(VMID, PIDFILE) or "null")
        outcomes = [clear_outcome(p) for p in plays]
        said = [o if o == "ok" else "failed: another deploy" if o else f"failed unclearly (rc {p.rc})"
                for o, p in zip(outcomes, plays, strict=True)]
        ending = (f"trial {number} (second {offset} s after the first): {', '.join(said)}; "
                  f"{len(samples)} samples, {len(runs)} run(s) at the end")
        for outcome in outcomes:
            tally["ok" if outcome == "ok" else "clear" if outcome else "unclear"] += 1
        print(ending)
        if len(samples) < 10:
            problems.append(f"trial {number}: only {len(samples)} samples")
        problems += [f"trial {number}: {b}" for b in overlaps(samples)]
        if len(runs) != 1 or not record or runs[0].pid != record["pid"] \
                or not still_there(table, record["pid"], record["start_time"]):
            found = [(p.pid, p.argv) for p in runs]
            problems.append(f"trial {number}: runs at the end {found}, pidfile {record}")
        elif before and record["pid"] == before["pid"]:
            problems.append(f"trial {number}: neither playbook restarted the run {before['pid']}")
        if "ok" not in outcomes:
            problems.append(f"trial {number}: neither playbook succeeded")
        for outcome, play in zip(outcomes, plays, strict=True):
            if outcome is None:
                problems.append(f"trial {number}: a playbook failed without saying why clearly: {play}")
    print(f"concurrent restarts: {len(offsets)} trials, {2 * len(offsets)} playbooks: "
          f"{tally['ok']} succeeded, {tally['clear']} failed clearly (another deploy), "
          f"{tally['unclear']} failed unclearly (seed {seed})")
    assert not problems, "\n".join(problems)
