"""Fleet rollout: `deploy.yml` without the run's start to 1, 2, 4 and 8 containers over 2 simulated nodes.

Each size gets its own pvesim (own state dir under a temp dir, taken down in a `finally`), with
containers 200.. spread over the nodes in contiguous blocks, and one `deploy.yml
-e dflash_fleet_start_run=false` (node checks, the trainer's venv, the release validated and made
live; no run started) with the project's ansible.cfg (its forks, 10) and the playbook's default
rollout (one batch without the run's start; with it, `serial: [1, '100%']`: the first container
alone, then the rest together; `--serial` passes another). Reported per size: the wall time and
its ratio to one container. `--with-start` lets deploy.yml start the run too (the sim's tiny CPU
run), and shows that part apart.

Where the time goes comes from the per-task start/end times in ansible-runner's event stream
(the same figures as `profile_tasks`), grouped by kind of work: the node checks (one
`pct_container_check` call per container over ssh), container tasks through `pct_pipelined` (ssh to
the node, then one `pct exec`): the venv module call and the release's one call (unpack of the archive
that rides in the task's arguments, validation, switch), and the controller's wheel build and
packing. Also reported: the bytes each container gets in task arguments, the load average before
and after each size (the machine may be shared), and, on the largest sim before its deploy, the
connection alone: raw ssh, raw `pct exec`, an Ansible ping through each connection, a copy of a
small and an 8 MiB file through `cat`, and the round trips one task costs.

Provisioning (`provision.yml`, after the deploys; `--provision-sizes`, `--no-provision`): each size
gets a fresh sim whose nodes have one container without GPUs each, and that many new containers in
the inventory spread over the nodes, one GPU each; reported per size: the wall time of the run that
creates them (pct create, start, the NVIDIA user-space tools, the GPU check), its ratio to one
container, and the wall time of the second run (nothing to change).

    python -m benchmarks.fleet                     # sizes 1 2 4 8, provisioning 1 and 8
    python -m benchmarks.fleet --sizes 1 8 --no-probes
    python -m benchmarks.fleet --sizes 1 8 --serial 100% --with-start
"""

from __future__ import annotations

import argparse
import configparser
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import simbench
from benchmarks.simbench import CATEGORIES, median
from pvesim.fleet import REPO

FIRST_VMID = 200
PROVISION_VARS = dict(proxmox_provision_cores=2, proxmox_provision_memory=4096,
                      proxmox_provision_rootfs_size=8)
START = "run start + health (waits, polls, gpu_verify)"


def configured_forks() -> int:
    """The forks of the project's ansible.cfg (Ansible's own default, 5, when it sets none)."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "ansible.cfg")
    return cfg.getint("defaults", "forks", fallback=5)


def payload_bytes(rows: list[simbench.TaskRun]) -> dict:
    """Bytes of the release archive (base64) that ride in each container's task arguments."""
    out = {}
    for row in rows:
        for result in row.hosts.values():
            try:
                built = json.loads(result.get("stdout") or "")
            except (json.JSONDecodeError, TypeError):
                continue
            if not isinstance(built, dict):
                continue
            # The batch's pack prints one object per host.
            for found in (v for v in built.values() if isinstance(v, dict)):
                if "archive_b64" in found and os.path.exists(found["archive_b64"]):
                    out["archive_b64"] = os.path.getsize(found["archive_b64"])
    return out


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
        if res.rc != 0:
            raise RuntimeError(f"ansible {pattern} -m {module}: {res}")
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
        text = res.stdout
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
        if not args.with_start:
            extra += ["-e", "dflash_fleet_start_run=false"]
        keep = args.keep_json / f"fleet-deploy-{n}.json" if args.keep_json else None
        load_before = os.getloadavg()[0]
        wall, res = simbench.timed_play(fleet, "deploy.yml", *extra, keep_json=keep)
        rows = res.tasks
        cats = simbench.summarize_categories(rows)
        start_s = cats[START]["seconds"]
        batches = len([name for name in res.plays if name.startswith("Deploy")])
        remote = simbench.remote_task_seconds(rows)
        return {
            "containers": n, "nodes": nodes, "batches": batches, "deploy_s": round(wall, 1),
            "run_start_s": round(start_s, 1), "deploy_without_start_s": round(wall - start_s, 1),
            "tasks_run": sum(1 for r in rows if r.ran),
            "cheap_container_task_s": median(remote),
            "changed": simbench.recap(res, hosts),
            "payload_bytes": payload_bytes(rows),
            "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "categories": cats, "probe": probe,
        }
    finally:
        fleet.down()


def provision_size(n: int, args, work: Path) -> dict:
    """provision.yml creating `n` containers (one GPU each) over the nodes, then run again."""
    nodes = min(args.nodes, n)
    existing = [100 + i for i in range(nodes)]  # one container without GPUs per node
    base = Path(tempfile.mkdtemp(prefix=f"provision{n}-", dir=work))
    fleet = simbench.bring_up(base, nodes, existing, gpu_passthrough={vmid: [] for vmid in existing})
    try:
        per_node = -(-n // nodes)
        for i, vmid in enumerate(range(FIRST_VMID, FIRST_VMID + n)):
            fleet.add_to_inventory(f"pve{i // per_node + 1}", vmid, proxmox_provision_gpus=[i % per_node],
                                   **PROVISION_VARS)
        new = ",".join(f"ct{v}" for v in range(FIRST_VMID, FIRST_VMID + n))
        load_before = os.getloadavg()[0]
        wall, res = simbench.timed_play(fleet, "provision.yml", "-l", new)
        again, res_again = simbench.timed_play(fleet, "provision.yml", "-l", new)
        return {"containers": n, "nodes": nodes, "provision_s": round(wall, 1), "again_s": round(again, 1),
                "changed": sum(stats["changed"] for stats in res.stats.values()),
                "changed_again": sum(stats["changed"] for stats in res_again.stats.values()),
                "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    finally:
        fleet.down()


def print_provision_table(results: list[dict]) -> None:
    head = (f"\n{'new containers':>14} {'nodes':>5} {'provision s':>11} {'x one':>6} {'changed':>7} "
            f"{'again s':>8} {'changed':>7} {'load before/after':>17}")
    print(head)
    print("-" * len(head))
    for r in results:
        r["ratio"] = round(r["provision_s"] / results[0]["provision_s"], 2)
        load = "/".join(f"{x:.1f}" for x in r["loadavg_1min"])
        print(f"{r['containers']:>14} {r['nodes']:>5} {r['provision_s']:>11.1f} {r['ratio']:>6.2f} "
              f"{r['changed']:>7} {r['again_s']:>8.1f} {r['changed_again']:>7} {load:>17}")


def print_tables(results: list[dict], target: float, with_start: bool) -> dict:
    one = results[0]
    start_head = f" {'run start s':>11} {'w/o start s':>11} {'x one':>6}" if with_start else ""
    head = (f"\n{'containers':>10} {'nodes':>5} {'batches':>7} {'deploy s':>9} {'x one':>6}{start_head} "
            f"{'tasks':>6} {'cheap task s':>12} {'load before/after':>17}")
    print(head)
    print("-" * len(head))
    for r in results:
        r["ratio"] = round(r["deploy_s"] / one["deploy_s"], 2)
        r["ratio_without_start"] = round(r["deploy_without_start_s"] / one["deploy_without_start_s"], 2)
        start_cells = (f" {r['run_start_s']:>11.1f} {r['deploy_without_start_s']:>11.1f} "
                       f"{r['ratio_without_start']:>6.2f}") if with_start else ""
        load = "/".join(f"{x:.1f}" for x in r["loadavg_1min"])
        print(f"{r['containers']:>10} {r['nodes']:>5} {r['batches']:>7} {r['deploy_s']:>9.1f} "
              f"{r['ratio']:>6.2f}{start_cells} {r['tasks_run']:>6} "
              f"{r['cheap_container_task_s'] or 0:>12.2f} {load:>17}")

    print("\nwhere the time goes: sum of task wall times (a task's time is its slowest host in the batch);")
    print("s/n/m: seconds over n task runs, m seconds a task run")
    head = f"{'kind of work':<52}" + "".join(f" {str(r['containers']) + ' ct':>19}" for r in results)
    print(head)
    print("-" * len(head))
    for cat in CATEGORIES:
        if not any(r["categories"][cat]["tasks"] for r in results):
            continue
        cells = ""
        for r in results:
            c = r["categories"][cat]
            each = c["seconds"] / c["tasks"] if c["tasks"] else 0
            cells += f" {c['seconds']:>7.1f}s/{c['tasks']:<3}/{each:<5.2f}"
        print(f"{cat:<52}{cells}")
    rest = "".join(f" {r['deploy_s'] - sum(c['seconds'] for c in r['categories'].values()):>7.1f}s"
                   + " " * 11 for r in results)
    print(f"{'ansible-playbook start, inventory, between tasks':<52}{rest}")
    sizes = one["payload_bytes"]
    if sizes:
        print("bytes in each container's task arguments (base64, no separate transfer): "
              + ", ".join(f"{k.removesuffix('_b64')} {v / 1024:.0f} KiB" for k, v in sorted(sizes.items())))

    probe = next((r["probe"] for r in results if r["probe"]), None)
    if probe:
        print(f"\nconnection alone ({probe['containers_pinged']}-container sim, before its deploy; medians)")
        for key, label in (
            ("ssh_node_true_s", "ssh node true"),
            ("ssh_pct_exec_true_s", "ssh node pct exec CT -- true"),
            ("ssh_pct_exec_python_s", "ssh node pct exec CT -- python3 -c pass"),
            ("ansible_localhost_ping_s", "ansible localhost -m ping (process start)"),
            ("ansible_node_ping_s", "ansible node -m ping (ssh, pipelining)"),
            ("ansible_ct_ping_s", "ansible CT -m ping (pct_pipelined)"),
            ("ansible_ct_copy_small_s", "ansible CT -m copy, a few bytes"),
            ("ansible_ct_copy_8mib_s", "ansible CT -m copy, 8 MiB"),
            ("ansible_all_ct_ping_s",
             f"ansible all {probe['containers_pinged']} CTs -m ping (forks {configured_forks()})"),
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
    what = "with the run's start" if with_start else "deploy.yml without the run's start"
    print(f"\ntarget: {last['containers']} containers <= {target}x one ({what}): {last['ratio']:.2f}x "
          f"{'PASS' if verdict else 'FAIL'}"
          + (f" (start taken out: {last['ratio_without_start']:.2f}x)" if with_start else ""))
    return {"target_ratio": target, "target_pass": verdict}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8],
                        help="numbers of containers, each in a fresh sim (the first is the reference)")
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes (fewer when fewer containers)")
    parser.add_argument("--serial", default=None,
                        help="pass -e dflash_fleet_serial=VALUE (default: the playbook's: 100%% without "
                             "the run's start, [1, '100%%'] with it)")
    parser.add_argument("--with-start", action="store_true",
                        help="let deploy.yml start the run too (its start and health shown apart)")
    parser.add_argument("--no-probes", action="store_true", help="skip the connection-alone timings")
    parser.add_argument("--probe-repeats", type=int, default=3, help="repeats of each connection timing")
    parser.add_argument("--target", type=float, default=2.5, help="largest size's allowed ratio to the first")
    parser.add_argument("--provision-sizes", type=int, nargs="+", default=[1, 8],
                        help="numbers of new containers provision.yml creates, each in a fresh sim")
    parser.add_argument("--no-provision", action="store_true", help="skip the provisioning measurement")
    parser.add_argument("--no-deploy", action="store_true", help="skip the deploy measurement")
    parser.add_argument("--keep-json", type=Path, default=None,
                        help="write each play's task runs and recap (JSON) to this directory")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = sorted(set(args.sizes))
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-fleet-"))
    started = time.monotonic()
    load_start = [round(x, 2) for x in os.getloadavg()]
    results, provisioned = [], []
    try:
        for n in [] if args.no_deploy else sizes:
            run = " with the run's start" if args.with_start else ""
            print(f"deploy.yml to {n} container(s){run} ...", flush=True)
            results.append(run_size(n, args, work, probes=not args.no_probes and n == sizes[-1]))
            print(f"  {results[-1]['deploy_s']} s", flush=True)
        for n in [] if args.no_provision else sorted(set(args.provision_sizes)):
            print(f"provision.yml creating {n} container(s) ...", flush=True)
            provisioned.append(provision_size(n, args, work))
            print(f"  {provisioned[-1]['provision_s']} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    verdict = print_tables(results, args.target, args.with_start) if results else {}
    if provisioned:
        print_provision_table(provisioned)
    print(json.dumps({
        "benchmark": "fleet", "cpus": os.cpu_count(), "loadavg_start": load_start,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()], "forks": configured_forks(),
        "serial": args.serial or ("[1, '100%']" if args.with_start else "100%") + " (playbook default)",
        "run_started": args.with_start,
        "sizes": results, "provision": provisioned, **verdict,
        "total_s": round(time.monotonic() - started, 1),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
