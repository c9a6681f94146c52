"""Fleet rollout: `deploy.yml` to 1, 2, 4 and 8 fresh containers over 2 simulated nodes.

Each size gets its own pvesim (own state dir under a temp dir, taken down in a `finally`), with
containers 200.. spread over the nodes in contiguous blocks, and one `deploy.yml` with the
project's ansible.cfg (default forks) and the playbook's default rollout (`serial: [1, '100%']`:
the first container alone, then the rest together). Reported per size: the wall time, its ratio to
one container, and the same with the run's start taken out.

deploy.yml has no variable that skips the run's start (dflash_run is always included), so the run
starts with the sim's smallest config (inventory/sim/group_vars: one process on CPU, a tiny
target); the time of the start and its health checks is measured from the task timings and shown
apart, and "without start" subtracts it.

Where the time goes comes from the per-task start/end times of the `ansible.posix.json` callback
(the same figures as `profile_tasks`), grouped by kind of work: the node checks over ssh, container
tasks through `proxmox_pct_remote` (ssh to the node, then `pct exec`; a file goes as `cat > dest`),
the venv and the wheel's pip install, the probe of the venv in the container, and so on. On
the largest sim, before its deploy, it also times the connection alone: raw ssh, raw `pct exec`, an
Ansible ping through each connection, and a copy of a small and a larger file.

    python benchmarks/fleet.py                     # sizes 1 2 4 8
    python benchmarks/fleet.py --sizes 1 4 --no-probes
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import simbench  # noqa: E402
from simbench import CATEGORIES, median  # noqa: E402

FIRST_VMID = 200


def layout(n: int, nodes: int) -> tuple[int, list[int]]:
    return min(nodes, n), list(range(FIRST_VMID, FIRST_VMID + n))


def probe_connection(fleet, vmids, repeats: int) -> dict:
    """Time the connection alone, before anything is deployed (no trainer takes CPU yet)."""
    sim, inv = fleet.sim, fleet.inventory
    vmid = vmids[0]
    node = sim.node_of(vmid).name
    out = {}

    def raw(cmd):
        t, res = simbench.timed(sim.ssh, node, cmd)
        if res.returncode != 0:
            raise RuntimeError(f"{cmd}: {res.stderr}")
        return t

    out["ssh_node_true_s"] = median([raw("true") for _ in range(repeats)])
    out["ssh_pct_exec_true_s"] = median([raw(f"/usr/sbin/pct exec {vmid} -- true") for _ in range(repeats)])
    out["ssh_pct_exec_python_s"] = median(
        [raw(f"/usr/sbin/pct exec {vmid} -- /usr/bin/python3 -c pass") for _ in range(repeats)])

    def adhoc(pattern, module, args=None):
        t, res = simbench.ansible_adhoc(inv, pattern, module, args)
        if res.returncode != 0:
            raise RuntimeError(f"ansible {pattern} -m {module}: {res.stdout[-2000:]} {res.stderr[-2000:]}")
        return t

    out["ansible_localhost_ping_s"] = median(
        [adhoc("localhost", "ansible.builtin.ping") for _ in range(repeats)])
    out["ansible_node_ping_s"] = median([adhoc(node, "ansible.builtin.ping") for _ in range(repeats)])
    out["ansible_ct_ping_s"] = median([adhoc(f"ct{vmid}", "ansible.builtin.ping") for _ in range(repeats)])
    blob = fleet.base / "blob.bin"
    blob.write_bytes(os.urandom(8 << 20))
    out["ansible_ct_copy_small_s"] = median(
        [adhoc(f"ct{vmid}", "ansible.builtin.copy", f"content=x{i} dest=/tmp/bench-small")
         for i in range(repeats)])
    big = []
    for _ in range(repeats):
        blob.write_bytes(os.urandom(8 << 20))  # new content each time: the copy really transfers
        big.append(adhoc(f"ct{vmid}", "ansible.builtin.copy", f"src={blob} dest=/tmp/bench-big"))
    out["ansible_ct_copy_8mib_s"] = median(big)
    # What one task costs in round trips: paramiko connections, pct exec calls and cat transfers.
    for key, module, margs in (("ping", "ansible.builtin.ping", None),
                               ("copy", "ansible.builtin.copy", "content=round-trips dest=/tmp/bench-rt")):
        _, res = simbench.ansible_adhoc(inv, f"ct{vmid}", module, margs, verbose=True)
        text = res.stdout + res.stderr
        out[f"{key}_connections"] = text.count("ESTABLISH PARAMIKO SSH CONNECTION")
        out[f"{key}_pct_execs"] = text.count("EXEC /usr/sbin/pct exec") + text.count("EXEC sudo")
        out[f"{key}_cat_puts"] = text.count("PUT ")
    out["ansible_all_ct_ping_s"] = median([adhoc("training_containers", "ansible.builtin.ping")
                                           for _ in range(repeats)])
    out["containers_pinged"] = len(vmids)
    base = out["ansible_localhost_ping_s"]
    out["per_task_ct_s"] = round(out["ansible_ct_ping_s"] - base, 2)
    out["per_task_node_s"] = round(out["ansible_node_ping_s"] - base, 2)
    extra = out["ansible_ct_copy_8mib_s"] - out["ansible_ct_copy_small_s"]
    # Below a few tenths of a second the 8 MiB cost nothing measurable next to the round trips.
    out["cat_mib_per_s"] = round(8 / extra, 1) if extra > 0.3 else None
    return out


def run_size(n: int, args, work: Path, probes: bool) -> dict:
    nodes, vmids = layout(n, args.nodes)
    base = Path(tempfile.mkdtemp(prefix=f"size{n}-", dir=work))
    hosts = [f"ct{v}" for v in vmids]
    fleet = simbench.bring_up(base, nodes, vmids)
    try:
        probe = probe_connection(fleet, vmids, args.probe_repeats) if probes else None
        extra = ["-e", f"dflash_fleet_serial={args.serial}"] if args.serial else []
        keep = args.keep_json / f"fleet-deploy-{n}.json" if args.keep_json else None
        wall, res = simbench.timed_play(fleet, "deploy.yml", *extra, keep_json=keep)
        rows = simbench.task_rows(res.data)
        cats = simbench.summarize_categories(rows)
        start_s = cats["run start + health (waits, polls, gpu_verify)"]["seconds"]
        batches = len([p for p in res.data.get("plays", []) if p["play"]["name"].startswith("Deploy")])
        remote = simbench.remote_task_seconds(rows)
        return {
            "containers": n, "nodes": nodes, "batches": batches, "deploy_s": round(wall, 1),
            "run_start_s": round(start_s, 1), "deploy_without_start_s": round(wall - start_s, 1),
            "tasks_run": sum(1 for r in rows if r["ran"]),
            "cheap_container_task_s": median(remote),
            "changed": simbench.recap(res, hosts),
            "categories": cats, "probe": probe,
        }
    finally:
        fleet.down()


def print_tables(results: list[dict], target: float) -> dict:
    one = results[0]
    print(f"\n{'containers':>10} {'nodes':>5} {'batches':>7} {'deploy s':>9} {'x one':>6} "
          f"{'run start s':>11} {'w/o start s':>11} {'x one':>6} {'tasks':>6} {'cheap task s':>12}")
    print("-" * 92)
    for r in results:
        r["ratio"] = round(r["deploy_s"] / one["deploy_s"], 2)
        r["ratio_without_start"] = round(r["deploy_without_start_s"] / one["deploy_without_start_s"], 2)
        print(f"{r['containers']:>10} {r['nodes']:>5} {r['batches']:>7} {r['deploy_s']:>9.1f} "
              f"{r['ratio']:>6.2f} {r['run_start_s']:>11.1f} {r['deploy_without_start_s']:>11.1f} "
              f"{r['ratio_without_start']:>6.2f} "
              f"{r['tasks_run']:>6} {r['cheap_container_task_s'] or 0:>12.2f}")

    print("\nwhere the time goes: sum of task wall times (a task's time is its slowest host in the batch)")
    head = f"{'kind of work':<46}" + "".join(f" {str(r['containers']) + ' ct':>14}" for r in results)
    print(head)
    print("-" * len(head))
    for cat in CATEGORIES:
        cells = "".join(f" {r['categories'][cat]['seconds']:>8.1f}s/{r['categories'][cat]['tasks']:<4}"
                        for r in results)
        print(f"{cat:<46}{cells}")
    rest = "".join(f" {r['deploy_s'] - sum(c['seconds'] for c in r['categories'].values()):>8.1f}s     "
                   for r in results)
    print(f"{'ansible-playbook start, inventory, between tasks':<46}{rest}")
    print("(s/n: seconds over n task runs; a batch counts once per task)")

    probe = next((r["probe"] for r in results if r["probe"]), None)
    if probe:
        print(f"\nconnection alone ({probe['containers_pinged']}-container sim, before its deploy; medians)")
        for key, label in (
            ("ssh_node_true_s", "ssh node true"),
            ("ssh_pct_exec_true_s", "ssh node pct exec CT -- true"),
            ("ssh_pct_exec_python_s", "ssh node pct exec CT -- python3 -c pass"),
            ("ansible_localhost_ping_s", "ansible localhost -m ping (process start)"),
            ("ansible_node_ping_s", "ansible node -m ping (ssh, pipelining)"),
            ("ansible_ct_ping_s", "ansible CT -m ping (proxmox_pct_remote)"),
            ("ansible_ct_copy_small_s", "ansible CT -m copy, a few bytes"),
            ("ansible_ct_copy_8mib_s", "ansible CT -m copy, 8 MiB"),
            ("ansible_all_ct_ping_s", f"ansible all {probe['containers_pinged']} CTs -m ping (forks 10)"),
        ):
            print(f"  {label:<50} {probe[key]:>6.2f} s")
        print(f"  round trips: ping {probe['ping_connections']} ssh connection(s), "
              f"{probe['ping_pct_execs']} pct exec, "
              f"{probe['ping_cat_puts']} cat put; copy {probe['copy_connections']} connection(s), "
              f"{probe['copy_pct_execs']} pct exec, {probe['copy_cat_puts']} cat put(s)")
        print(f"  one container task costs about {probe['per_task_ct_s']:.2f} s of connection "
              f"(node task {probe['per_task_node_s']:.2f} s); "
              + (f"cat moves about {probe['cat_mib_per_s']} MiB/s" if probe["cat_mib_per_s"]
                 else "8 MiB through cat costs no more than a few bytes: the round trips are the cost"))

    last = results[-1]
    verdict = last["ratio"] <= target
    print(f"\ntarget: {last['containers']} containers <= {target}x one: {last['ratio']:.2f}x "
          f"{'PASS' if verdict else 'FAIL'} (without the run's start: {last['ratio_without_start']:.2f}x)")
    return {"target_ratio": target, "target_pass": verdict}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python benchmarks/fleet.py", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="numbers of containers, each in a fresh sim (the first is the reference)")
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (fewer when fewer containers)")
    parser.add_argument("--serial", default=None,
                        help="pass -e dflash_fleet_serial=VALUE (default: the playbook's [1, '100%%'])")
    parser.add_argument("--no-probes", action="store_true", help="skip the connection-alone timings")
    parser.add_argument("--probe-repeats", type=int, default=3, help="repeats of each connection timing")
    parser.add_argument("--target", type=float, default=2.5, help="largest size's allowed ratio to the first")
    parser.add_argument("--keep-json", type=Path, default=None,
                        help="write each play's ansible.posix.json output to this directory")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = sorted(set(args.sizes))
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-fleet-"))
    started = time.monotonic()
    results = []
    try:
        for n in sizes:
            print(f"deploy.yml to {n} container(s) ...", flush=True)
            results.append(run_size(n, args, work, probes=not args.no_probes and n == sizes[-1]))
            print(f"  {results[-1]['deploy_s']} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    verdict = print_tables(results, args.target)
    print(json.dumps({
        "benchmark": "fleet", "cpus": os.cpu_count(),
        "loadavg_end": [round(x, 2) for x in os.getloadavg()], "forks": "ansible.cfg default",
        "serial": args.serial or "[1, '100%'] (playbook default)", "sizes": results, **verdict,
        "total_s": round(time.monotonic() - started, 1),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
