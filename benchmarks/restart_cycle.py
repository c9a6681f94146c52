"""Restart cycle on one container: `restart_training.yml` and a no-change `deploy.yml`, against pvesim.

One container (CT 200) in its own pvesim (own state dir under a temp dir, taken down in a
`finally`), set up as the role tests set up a deploy (`pvesim.fleet.Fleet`: the sim inventory's
group_vars, a snapshot of the source, the tiny demo assets). One `deploy.yml` gets a
run going; then, `--repeats` times:

- `restart_training.yml`, its wall time split into
  - the trainer's own stop: `seconds` of the stop's `training_run` result (SIGTERM to the process
    gone, the checkpoint included);
  - the trainer's own start: from the new process's start (`/proc/<pid>/stat` in the container)
    to its first `step` line in the run's log (imports, model load, resume, first step; the start
    task waits for that line in the container, so this time is inside it);
  - Ansible's part: the rest (connections, the deploy steps the restart repeats, GPU checks, any
    pause), shown by kind of work from the per-task times;
  and checked: the new run resumed from the checkpoint the old one wrote when it stopped;
- a no-change `deploy.yml`: wall time and `changed` from the play recap (expected 0, same pid).

With `--baseline REV` that revision's playbooks and collection (`benchmarks/sidebyside.py`) take turns
with this tree's on the same run: each repeat restarts with the baseline, then with this tree (each
restart stops the run the other started), then the no-change deploys: both sides measured in one run.

Reference row: the seeds' hand ritual, scripted against the same container: ssh to the node,
`pct exec 200 -- bash -lc 'pkill -f <trainer> || true; sleep 5; nvidia-smi ...'`, a copy of the
changed file to the node's /root, and a start with `nohup ... &`. It is fast because it checks
nothing; what it leaves unverified is listed next to it, with what this benchmark observed.

The GPU idle window of each restart: from the old run's stop request (the SIGTERM, its `stop` line's
`signalled_at`) to the new run's first training step, split into the trainer's own stop, its own start
and Ansible's share (the rest: the pidfile's removal, the GPU idle check and the spawn, between the old
run's exit and the new one's start). Until the SIGTERM the old run trains: the time from its last `step`
line to the signal is its step in progress (in the sim, its `run.step_delay` pause, 2 s, standing for a
step's compute, which the signal cuts short), reported beside the window, not in it. The restart does
its deploy steps while the old run still trains, so they are outside the window. (The stop's `seconds`
come from the task that stopped: a stop of its own, or this tree's one call that stops, checks the GPUs
idle under the run's lock and starts.)

Targets (this tree): Ansible's part of a restart <= 10 s; Ansible's share of the idle window <= 0.3 s;
a no-change deploy <= 6 s with changed=0.

    python -m benchmarks.restart_cycle                 # 2 repeats
    python -m benchmarks.restart_cycle --repeats 5 --no-reference --baseline main
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import sidebyside, simbench
from benchmarks.simbench import CATEGORIES, median
from pvesim.fleet import REPO

# How a stop ended, in the result of the task that stopped the run: a stop of its own (a baseline's
# roles), or the one call that stops, checks the GPUs idle and starts (this tree's).
STOP_ENDS = ("terminated", "killed")
LOG = "/var/log/dflash/main.log"
RITUAL_LOG = "/var/log/dflash/ritual.log"
# The seeds' pattern was the script's name (train_dflash_pipeline.py); here it is the trainer's module.
RITUAL_PATTERN = "dflash_ops.train"

# Epoch at which a container process started, from inside the container (its /proc): the kernel's
# uptime and the process's start time in clock ticks (field 22 of /proc/<pid>/stat).
PROC_START = (
    "import os, sys, time\n"
    "now = time.time(); up = float(open('/proc/uptime').read().split()[0])\n"
    "ticks = int(open('/proc/%d/stat' % int(sys.argv[1])).read().rsplit(')', 1)[1].split()[19])\n"
    "print(now - up + ticks / os.sysconf('SC_CLK_TCK'))\n"
)


def events(fleet, vmid, path=LOG) -> list[dict]:
    out = []
    for line in (fleet.read(vmid, path) or "").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return out


def process_start(fleet, vmid, pid) -> float | None:
    res = fleet.ct(vmid, f"/usr/bin/python3 -c {shlex.quote(PROC_START)} {int(pid)}")
    return float(res.stdout) if res.returncode == 0 else None


def wait_first_step(fleet, vmid, since: float, path=LOG, timeout=120) -> dict | None:
    """The first `step` event logged at or after `since` (epoch), waiting for it up to `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        step = next((e for e in events(fleet, vmid, path)
                     if e.get("event") == "step" and e["time"] >= since), None)
        if step or time.monotonic() > deadline:
            return step
        time.sleep(1)


def stop_result(res, host) -> dict:
    """The result of the task that stopped the run (its `seconds`: SIGTERM to the run gone)."""
    return next((result for _, name, result in res.host_results()
                 if name == host and result.get("how") in STOP_ENDS), {})


def measure_restart(fleet, vmid, keep_json, i, tree) -> dict:
    host = f"ct{vmid}"
    before = fleet.run_info(vmid)
    keep = keep_json / f"restart-{tree.label.split()[0]}-{i}.json" if keep_json else None
    wall, res = simbench.timed_play(fleet, "restart_training.yml", keep_json=keep, tree=tree)
    stop = stop_result(res, host)
    after = fleet.run_info(vmid)
    started_at = process_start(fleet, vmid, after["pid"])
    step = wait_first_step(fleet, vmid, started_at) if started_at else None
    trainer_start = (step["time"] - started_at) if step else None
    log = events(fleet, vmid)
    new = [e for e in log if started_at and e["time"] >= started_at]
    old = [e for e in log if started_at and e["time"] < started_at]
    resume = next((e for e in new if e.get("event") == "resume"), None)
    last_ckpt = next((e for e in reversed(old) if e.get("event") == "checkpoint"), None)
    stop_event = next((e for e in reversed(old) if e.get("event") == "stop"), None)
    last_old_step = next((e for e in reversed(old) if e.get("event") == "step"), None)
    # The GPUs' idle window: from the old run's stop request (its `stop` line's `signalled_at`: until then
    # it trains, the sim's step pause standing for a step's compute, which the SIGTERM cuts short) to the
    # new run's first step; without that field, from the old run's last training step.
    signalled = (stop_event or {}).get("signalled_at")
    since = signalled or (last_old_step or {}).get("time")
    window = (step["time"] - since) if step and since else None
    cats = simbench.summarize_categories(res.tasks)
    stop_s = float(stop.get("seconds", 0.0))
    settle = sum(r.seconds for r in res.tasks if r.ran and r.action == "ansible.builtin.pause")
    return {
        "wall_s": round(wall, 2),
        "trainer_stop_s": round(stop_s, 2),
        "trainer_start_s": round(trainer_start, 2) if trainer_start is not None else None,
        "ansible_s": round(wall - stop_s - (trainer_start or 0.0), 2),
        "settle_pause_s": round(settle, 2),
        "idle_window_s": round(window, 2) if window is not None else None,
        "idle_from": "signal" if signalled else "last step",
        # The new run's first step, torch.compile included where it compiles (its cache kept warm).
        "first_step_s": step.get("first_step_seconds") if step else None,
        # The old run's last step to the SIGTERM: training (a real run's step in progress), not idle.
        "step_in_progress_s": (round(signalled - last_old_step["time"], 2)
                               if signalled and last_old_step else None),
        # What of the window is neither the trainer's stop nor its start: Ansible's share.
        "idle_ansible_s": (round(window - stop_s - trainer_start, 2)
                           if window is not None and trainer_start is not None else None),
        "stop_how": stop.get("how"),
        "new_pid": after["pid"] != before["pid"],
        "checkpoint_on_stop": bool(stop_event and last_ckpt and last_ckpt["step"] == stop_event["step"]),
        "resumed_from_it": bool(resume and last_ckpt and resume["step"] == last_ckpt["step"]),
        "changed": simbench.recap(res, [host])[host],
        "categories": cats,
    }


def measure_noop(fleet, vmid, keep_json, i, tree) -> dict:
    host = f"ct{vmid}"
    before = fleet.run_info(vmid)
    keep = keep_json / f"noop-{tree.label.split()[0]}-{i}.json" if keep_json else None
    wall, res = simbench.timed_play(fleet, "deploy.yml", keep_json=keep, tree=tree)
    return {
        "wall_s": round(wall, 2),
        "changed": simbench.recap(res, [host])[host],
        "same_pid": fleet.run_info(vmid)["pid"] == before["pid"],
        "categories": simbench.summarize_categories(res.tasks),
    }


def trainers(fleet, vmid) -> list[int]:
    """Pids of trainer processes in the container, read from `ps` (for the report; nothing is signalled)."""
    out = fleet.ct(vmid, "ps -eo pid=,args=").stdout
    return [int(line.split(None, 1)[0]) for line in out.splitlines()
            if "-m dflash_ops.train" in line and "bash" not in line.split(None, 2)[1]]


def ritual_copy_path(changed_file: Path) -> str:
    return f"/root/dflash-bench-ritual-{os.getpid()}-{changed_file.name}"


def ritual(fleet, vmid, changed_file: Path, i: int) -> dict:
    """The seeds' stop-copy-start, by hand, against this benchmark's own pvesim container.

    THIS REPRODUCES THE BUG BEING MEASURED. `pkill -f` by a name pattern is never used anywhere
    else in the project. It runs only here, only inside CT `vmid` of the sim this benchmark brought
    up itself (its own state dir in a temp dir): `pct exec` enters the container's own PID
    namespace, so pkill sees only that container's processes, and the shell first checks the
    container's hostname so that nothing is signalled if it is not in that container.
    """
    node = fleet.sim.node_of(vmid).name
    host = f"ct{vmid}"
    before = trainers(fleet, vmid)

    # 1. Copy the changed file to the node's /root, as the seeds did (scp root@node:/root/). A sim
    # node's filesystem is this machine's: the name is this benchmark's own, removed at the end.
    dest = ritual_copy_path(changed_file)
    t0 = time.monotonic()
    copy = fleet.sim.ssh(node, f"cat > {shlex.quote(dest)}", stdin=None, input=changed_file.read_text())
    copy_s = time.monotonic() - t0

    # 2. Stop: the seeds' one-liner. The shell's own command line contains the pattern.
    script = (f'[ "$(hostname)" = {host} ] || exit 97; '
              f"pkill -f {RITUAL_PATTERN} || true; sleep 5; "
              "nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader")
    t0 = time.monotonic()
    stop = fleet.sim.ssh(node, f"/usr/sbin/pct exec {vmid} -- /bin/bash -lc {shlex.quote(script)}")
    stop_s = time.monotonic() - t0
    if stop.returncode == 97:
        raise SystemExit(f"the ritual's shell was not in {host}; nothing was signalled")

    # 3. Start, detached. A plain `nohup ./run.sh ... &` keeps `pct exec` (lxc-attach) and so the
    # ssh waiting until the run ends; `setsid -f` puts it in a session of its own.
    start_script = f"cd /opt/dflash/current && setsid -f nohup ./run.sh >> {RITUAL_LOG} 2>&1 < /dev/null"
    t0 = time.monotonic()
    start = fleet.sim.ssh(node, f"/usr/sbin/pct exec {vmid} -- /bin/bash -lc {shlex.quote(start_script)}")
    start_s = time.monotonic() - t0
    started_epoch = time.time()

    # What the ritual did not check, observed by this benchmark afterwards (not part of its time).
    right_after = trainers(fleet, vmid)
    step = wait_first_step(fleet, vmid, started_epoch - start_s, path=RITUAL_LOG, timeout=90)
    landed_in_ct = fleet.ct(vmid, f"test -e {shlex.quote(dest)}").returncode == 0
    landed_on_node = fleet.sim.ssh(node, f"test -e {shlex.quote(dest)}").returncode == 0
    pidfile = fleet.run_info(vmid)
    pidfile_live = bool(pidfile) and fleet.alive(vmid, pidfile["pid"])
    return {
        "copy_s": round(copy_s, 2), "stop_s": round(stop_s, 2), "start_s": round(start_s, 2),
        "wall_s": round(copy_s + stop_s + start_s, 2),
        "copy_rc": copy.returncode, "stop_rc": stop.returncode, "stop_output": stop.stdout.strip(),
        "start_rc": start.returncode,
        "trainers_before": len(before), "trainers_right_after_start": len(right_after),
        "old_trainer_still_there": bool(set(before) & set(right_after)),
        "new_run_logged_a_step": step is not None,
        "file_on_node": landed_on_node, "file_in_container": landed_in_ct,
        "pidfile_names_a_live_run": pidfile_live,
    }


def category_table(title: str, runs: list[dict]) -> None:
    print(f"\n{title}: median seconds over {len(runs)} run(s), by kind of work (tasks)")
    for cat in CATEGORIES:
        secs = median([r["categories"][cat]["seconds"] for r in runs])
        tasks = runs[0]["categories"][cat]["tasks"]
        if tasks:
            print(f"  {cat:<52} {secs:>6.1f} s  ({tasks} tasks)")
    rest = median([r["wall_s"] - sum(c["seconds"] for c in r["categories"].values()) for r in runs])
    print(f"  {'ansible-playbook start, inventory, between tasks':<52} {rest:>6.1f} s")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.restart_cycle",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="restarts and no-change deploys (median)")
    parser.add_argument("--ritual-repeats", type=int, default=3, help="runs of the hand ritual (median)")
    parser.add_argument("--no-reference", action="store_true", help="skip the hand ritual's row")
    parser.add_argument("--vmid", type=int, default=200, help="the container's id")
    parser.add_argument("--target-restart", type=float, default=10.0, help="Ansible's part of a restart, s")
    parser.add_argument("--target-noop", type=float, default=6.0, help="a no-change deploy, s")
    parser.add_argument("--target-idle", type=float, default=0.3,
                        help="the GPU idle window may exceed the trainer's own stop + start by this, s")
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also restart with this git revision's playbooks and collection, taking turns")
    parser.add_argument("--keep-json", type=Path, default=None,
                        help="write each play's task runs and recap (JSON) to this directory")
    return parser.parse_args(argv)


def medians(restarts, noops) -> dict:
    med = {k: median([r[k] for r in restarts]) for k in
           ("wall_s", "trainer_stop_s", "trainer_start_s", "ansible_s", "settle_pause_s", "idle_window_s",
            "idle_ansible_s", "step_in_progress_s", "first_step_s")}
    med["noop_wall_s"] = median([n["wall_s"] for n in noops])
    med["noop_changed"] = max(n["changed"] for n in noops)
    return med


def main(argv=None) -> int:
    args = parse_args(argv)
    vmid = args.vmid
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-restart-"))
    began = time.monotonic()
    trees = ([sidebyside.baseline(args.baseline, work)] if args.baseline else []) + [sidebyside.THIS_TREE]
    labels = [tree.label for tree in trees]
    fleet = simbench.bring_up(work, 1, [vmid])
    try:
        print(f"deploy.yml to CT {vmid} (first deploy: venv, release, run) ...", flush=True)
        first_s, _ = simbench.timed_play(fleet, "deploy.yml")
        # The first run's first step: a cold compile cache (later starts find it in the run's output dir).
        cold_step = next((e for e in events(fleet, vmid) if e.get("event") == "step"), {}).get(
            "first_step_seconds")
        restarts, noops = {label: [] for label in labels}, {label: [] for label in labels}
        # The trees take turns on the same run: each restart stops the run the other one started.
        for i in range(args.repeats):
            for tree in trees:
                restarts[tree.label].append(measure_restart(fleet, vmid, args.keep_json, i, tree))
                last = restarts[tree.label][-1]
                print(f"  {tree.label}: restart {i + 1}: {last['wall_s']} s, GPU idle window "
                      f"{last['idle_window_s']} s", flush=True)
                noops[tree.label].append(measure_noop(fleet, vmid, args.keep_json, i, tree))
                last = noops[tree.label][-1]
                print(f"  {tree.label}: no-change deploy {i + 1}: {last['wall_s']} s, "
                      f"changed={last['changed']}", flush=True)
        rituals = []
        if not args.no_reference:
            changed = work / "train.py"
            changed.write_text((REPO / "dflash_ops" / "train.py").read_text() + "# hand-copied fix\n")
            for i in range(args.ritual_repeats):
                rituals.append(ritual(fleet, vmid, changed, i))
                print(f"  hand ritual {i + 1}: {rituals[-1]['wall_s']} s, ssh exit {rituals[-1]['stop_rc']}",
                      flush=True)
    finally:
        fleet.down()
        Path(ritual_copy_path(work / "train.py")).unlink(missing_ok=True)
        shutil.rmtree(work, ignore_errors=True)

    med = {label: medians(restarts[label], noops[label]) for label in labels}
    print(f"\nCT {vmid}, one node; first deploy {first_s:.1f} s; medians of {args.repeats} run(s) per tree, "
          f"the trees taking turns")
    print(f"{'cycle':<46} {'wall s':>7} {'trainer stop':>12} {'trainer start':>13} {'ansible s':>9} "
          f"{'changed':>7}  verified")
    print("-" * 122)
    for label in labels:
        m, runs = med[label], restarts[label]
        print(f"{'restart_training.yml, ' + label:<46} {m['wall_s']:>7.1f} {m['trainer_stop_s']:>12.1f} "
              f"{m['trainer_start_s'] or 0:>13.1f} {m['ansible_s']:>9.1f} {runs[0]['changed']:>7}  "
              f"stop: {runs[0]['stop_how']}; "
              f"checkpoint on stop: {all(r['checkpoint_on_stop'] for r in runs)}; "
              f"resumed from it: {all(r['resumed_from_it'] for r in runs)}; GPUs idle then busy")
        print(f"{'deploy.yml, nothing changed, ' + label:<46} {m['noop_wall_s']:>7.1f} {'-':>12} {'-':>13} "
              f"{m['noop_wall_s']:>9.1f} {m['noop_changed']:>7}  run kept (same pid): "
              f"{all(n['same_pid'] for n in noops[label])}")
    if rituals:
        rmed = {k: median([r[k] for r in rituals]) for k in ("wall_s", "copy_s", "stop_s", "start_s")}
        r0 = rituals[0]
        print(f"{'hand ritual (seeds), reference':<34} {rmed['wall_s']:>7.1f} {rmed['stop_s']:>12.1f} "
              f"{rmed['start_s']:>13.1f} {'-':>9} {'?':>7}  nothing (see below)")
        print(f"\nhand ritual: copy {rmed['copy_s']:.2f} s + stop {rmed['stop_s']:.2f} s "
              f"+ start {rmed['start_s']:.2f} s"
              f" (medians of {len(rituals)}); what it does not verify, and what happened:")
        exits = sorted({r["stop_rc"] for r in rituals})
        notes = [
            ("shell killed by its own pkill -f",
             f"ssh exit status {exits} (143 = SIGTERM); output after the pkill: {r0['stop_output']!r}"),
            ("no GPU idle check", "the `sleep 5; nvidia-smi` after the pkill never ran (the shell was dead)"),
            ("no checkpoint wait", "SIGTERM and no wait for the trainer's checkpoint and exit; trainers "
             f"right after the start: {[r['trainers_right_after_start'] for r in rituals]} "
             f"(old one still there: {[r['old_trainer_still_there'] for r in rituals]})"),
            ("file landed on the node, not in the container",
             f"on the node's /root: {r0['file_on_node']}; in the container: {r0['file_in_container']}; "
             "the run imports /opt/dflash/current, so the copy is never run"),
            ("no pidfile",
             f"the product's pidfile names a live run afterwards: {r0['pidfile_names_a_live_run']}"
             " (the hand-started trainer is untracked)"),
            ("no health check", "nothing waits for a training step; one came later: "
             f"{[r['new_run_logged_a_step'] for r in rituals]}"),
        ]
        for what, seen in notes:
            print(f"  - {what}: {seen}")

    for label in labels:
        category_table(f"restart_training.yml, {label}", restarts[label])
        category_table(f"deploy.yml, nothing changed, {label}", noops[label])

    print("\nGPU idle window of a restart (the old run's stop request, its SIGTERM, to the new run's first "
          "training step), medians:")
    for label in labels:
        m = med[label]
        print(f"  {label}: {m['idle_window_s']} s = trainer stop {m['trainer_stop_s']} s + trainer start "
              f"{m['trainer_start_s']} s + Ansible's share {m['idle_ansible_s']} s "
              f"(per restart: {[r['idle_window_s'] for r in restarts[label]]}, Ansible's share "
              f"{[r['idle_ansible_s'] for r in restarts[label]]}; from {restarts[label][0]['idle_from']}); "
              f"before it, the old run's step in progress at the SIGTERM {m['step_in_progress_s']} s "
              f"(the sim's step pause, training: {[r['step_in_progress_s'] for r in restarts[label]]})")
    warm = ", ".join(f"{label} {med[label]['first_step_s']} s" for label in labels)
    print(f"  the first training step (inside the trainer's start): the first run's {cold_step} s (a cold "
          f"compile cache), after a restart (median) {warm} (warm: the cache kept in the run's output dir); "
          "on CPU nothing is compiled: this is the eager first step, cold and warm alike")
    this = med[labels[-1]]
    if len(labels) > 1 and this["idle_ansible_s"] is not None and med[labels[0]]["idle_ansible_s"]:
        print(f"  Ansible's share, {labels[-1]} / {labels[0]}: "
              f"{this['idle_ansible_s'] / med[labels[0]]['idle_ansible_s']:.2f}x")
    idle_pass = this["idle_ansible_s"] is not None and this["idle_ansible_s"] <= args.target_idle
    restart_pass = this["ansible_s"] <= args.target_restart
    noop_pass = this["noop_wall_s"] <= args.target_noop and this["noop_changed"] == 0
    print(f"\ntarget ({labels[-1]}): Ansible's part of a restart <= {args.target_restart:g} s: "
          f"{this['ansible_s']:.1f} s {'PASS' if restart_pass else 'FAIL'}")
    print(f"target ({labels[-1]}): Ansible's share of the GPU idle window (the window less the trainer's "
          f"stop and start) <= {args.target_idle:g} s: {this['idle_ansible_s']} s "
          f"{'PASS' if idle_pass else 'FAIL'}")
    print(f"target ({labels[-1]}): no-change deploy <= {args.target_noop:g} s with changed=0: "
          f"{this['noop_wall_s']:.1f} s, changed={this['noop_changed']} "
          f"{'PASS' if noop_pass else 'FAIL'}")
    print(json.dumps({
        "benchmark": "restart_cycle", "cpus": os.cpu_count(),
        "loadavg_end": [round(x, 2) for x in os.getloadavg()], "vmid": vmid, "repeats": args.repeats,
        "first_deploy_s": round(first_s, 1), "first_step_cold_s": cold_step,
        "trees": {label: {**med[label], "restarts": restarts[label], "noop_deploys": noops[label]}
                  for label in labels},
        "hand_ritual": ({"wall_s": median([r["wall_s"] for r in rituals]), "runs": rituals}
                        if rituals else None),
        "targets": {"restart_ansible_s": args.target_restart, "restart_pass": restart_pass,
                    "noop_deploy_s": args.target_noop, "noop_pass": noop_pass,
                    "idle_window_extra_s": args.target_idle, "idle_window_pass": idle_pass},
        "total_s": round(time.monotonic() - began, 1),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
