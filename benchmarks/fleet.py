"""Fleet rollout and what it costs the controller: `deploy.yml` without the run's start, a no-change
`deploy.yml` and `status.yml` to 1, 8 and 32 containers, 4 a node (1, 2 and 8 simulated nodes).

Each size gets its own pvesim (own state dir under a temp dir, taken down in a `finally`), containers
200.. in contiguous blocks over the nodes. On it, each tree measured runs, in turn: `deploy.yml -e
dflash_fleet_start_run=false` to fresh containers (node checks, the trainer's venv, the release validated
and made live; no run started), the same again (nothing to change), and `status.yml`. With `--baseline
REV` that revision's playbooks and collection (its own ansible.cfg and forks; `benchmarks/sidebyside.py`)
run the same three plays on the same sim first, the containers and the controller's release cache reset
before each tree's first deploy: both sides measured in one run. Each play is `ansible-playbook` itself:
its wall time and the CPU seconds of its process tree on the controller (`wait4`: what `/usr/bin/time`
reports), the simulated nodes' CPU seconds meanwhile (on this machine they share its cores with the
controller), and the task runs per container (host results in its output, skipped ones shown). Reported per
play: wall, CPU, the CPU each container past the first costs ((CPU at N - CPU at 1) / (N - 1)), the ratio
to the baseline, and the load average around each play (the machine may be shared).

Goals (this tree, largest size against one container): controller CPU per extra container <= 0.4 s for a
deploy and <= 0.25 s for a no-change deploy and for `status.yml`; a no-change deploy <= 3x one
container's wall.

On the largest sim, before its deploys, the connection alone (`--no-probes` skips it): raw ssh, raw `pct
exec`, an Ansible ping through each connection, a copy of a small and an 8 MiB file through `cat`, and
the round trips one task costs.

Provisioning (`provision.yml`, after the deploys; `--provision-sizes`, `--no-provision`): each size
gets a fresh sim whose nodes have one container without GPUs each, and that many new containers in
the inventory spread over the nodes, one GPU each; reported per size: the wall time of the run that
creates them (pct create, start, the NVIDIA user-space tools, the GPU check), its ratio to one
container, and the wall time of the second run (nothing to change).

    python -m benchmarks.fleet                               # sizes 1 8 32, provisioning 1 and 8
    python -m benchmarks.fleet --baseline main --no-provision --no-probes
    python -m benchmarks.fleet --sizes 1 8 --per-node 4
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

from benchmarks import sidebyside, simbench
from benchmarks.simbench import median

FIRST_VMID = 200
PROVISION_VARS = dict(proxmox_provision_cores=2, proxmox_provision_memory=4096,
                      proxmox_provision_rootfs_size=8)
# The plays measured on each tree, in this order, each with its arguments.
PLAYS = (("deploy", "deploy.yml", ("-e", "dflash_fleet_start_run=false")),
         ("no-change deploy", "deploy.yml", ("-e", "dflash_fleet_start_run=false")),
         ("status", "status.yml", ()))
# Goals of this tree: CPU seconds per container past the first, by play; the no-change deploy's wall at
# the largest size against one container's.
CPU_GOALS = {"deploy": 0.4, "no-change deploy": 0.25, "status": 0.25}
NOOP_WALL_GOAL = 3.0


def layout(n: int, per_node: int) -> tuple[int, list[int]]:
    return max(1, -(-n // per_node)), list(range(FIRST_VMID, FIRST_VMID + n))


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


def measure_trees(fleet, trees, vmids) -> dict:
    """{tree label: {play: measured_play's figures}} of every tree on this sim, the containers and the
    controller's release cache reset before each tree's first deploy."""
    out = {}
    for tree in trees:
        sidebyside.reset_containers(fleet, vmids)
        plays = {}
        for name, playbook, play_args in PLAYS:
            plays[name] = sidebyside.measured_play(fleet, tree, playbook, *play_args)
            hosts = plays[name]["host_results"]
            # The fewest: the first container also carries the play's run_once tasks.
            plays[name]["tasks_per_container"] = min(hosts.get(f"ct{v}", 0) for v in vmids)
            got = plays[name]
            print(f"  {tree.label:<22} {name:<17} wall {got['wall_s']:>6.1f} s  controller CPU "
                  f"{got['cpu_s']:>6.2f} s  nodes' CPU {got['nodes_cpu_s']:>6.2f} s  "
                  f"tasks/ct {got['tasks_per_container']}", flush=True)
        archives = sorted(fleet.build_dir.glob("*.tar.gz.b64"))
        plays["deploy"]["archive_b64_bytes"] = archives[0].stat().st_size if archives else None
        out[tree.label] = plays
    return out


def run_size(n: int, args, trees, work: Path, probes: bool) -> dict:
    nodes, vmids = layout(n, args.per_node)
    base = Path(tempfile.mkdtemp(prefix=f"size{n}-", dir=work))
    fleet = simbench.bring_up(base, nodes, vmids)
    try:
        probe = probe_connection(fleet, vmids, args.probe_repeats) if probes else None
        return {"containers": n, "nodes": nodes, "trees": measure_trees(fleet, trees, vmids),
                "probe": probe}
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


def per_extra_container(results, label, play, key="cpu_s"):
    """{size: (figure at size - figure at the first size) / (size - first size)} past the first size."""
    first = results[0]
    base, one = first["trees"][label][play][key], first["containers"]
    return {r["containers"]: round((r["trees"][label][play][key] - base) / (r["containers"] - one), 3)
            for r in results[1:]}


def print_tables(results: list[dict], labels: list[str]) -> dict:
    sizes = [r["containers"] for r in results]
    head = (f"\n{'play':<17} {'tree':<22}" + "".join(f" {f'{n} ct: CPU s (wall s)':>22}" for n in sizes)
            + "".join(f" {'per extra ct @' + str(n):>16}" for n in sizes[1:]) + f" {'tasks/ct':>8}")
    print("controller CPU seconds of the ansible-playbook process tree, wall seconds in brackets; per extra "
          "container: (CPU at N - CPU at one) / (N - 1)" + head)
    print("-" * len(head))
    verdicts, slopes = {}, {}
    for play, _, _ in PLAYS:
        for label in labels:
            got = [r["trees"][label][play] for r in results]
            cells = "".join(f" {g['cpu_s']:>12.2f} ({g['wall_s']:>6.1f})" for g in got)
            slope = per_extra_container(results, label, play) if len(results) > 1 else {}
            slopes.setdefault(label, {})[play] = slope
            tasks = results[-1]["trees"][label][play]["tasks_per_container"]
            print(f"{play:<17} {label:<22}{cells}" + "".join(f" {slope[n]:>16.3f}" for n in sizes[1:])
                  + f" {tasks:>8}")
    this = labels[-1]
    if len(labels) > 1:
        print(f"\n{this} against {labels[0]}: CPU ratio (lower is less controller work)")
        for play, _, _ in PLAYS:
            ratios = [r["trees"][this][play]["cpu_s"] / r["trees"][labels[0]][play]["cpu_s"] for r in results]
            print(f"  {play:<17}" + "".join(f" {n} ct {x:.2f}x" for n, x in zip(sizes, ratios, strict=True)))

    def loads(r):
        return ", ".join("/".join(f"{x:.1f}" for x in r["trees"][this][play]["loadavg_1min"])
                         for play, _, _ in PLAYS)

    print("\nload average (1 min) before/after each play, this tree: "
          + "; ".join(f"{r['containers']} ct {loads(r)}" for r in results))
    print("the simulated nodes' CPU seconds meanwhile (sshd, pct, lxc-attach, the modules in the containers; "
          "a real fleet's nodes have their own CPUs), this tree: " + "; ".join(
              f"{r['containers']} ct " + ", ".join(f"{play} {r['trees'][this][play]['nodes_cpu_s']:.1f}"
                                                 for play, _, _ in PLAYS) for r in results))
    if len(results) > 1:
        largest = results[-1]["containers"]
        for play, goal in CPU_GOALS.items():
            got = slopes[this][play][largest]
            verdicts[play] = got <= goal
            print(f"goal: {play} controller CPU per extra container <= {goal} s at {largest} ct: {got:.3f} s "
                  f"{'MET' if got <= goal else 'MISSED'}")
        noop = [r["trees"][this]["no-change deploy"]["wall_s"] for r in (results[0], results[-1])]
        verdicts["no-change wall"] = noop[1] <= NOOP_WALL_GOAL * noop[0]
        print(f"goal: no-change deploy of {largest} ct <= {NOOP_WALL_GOAL:g}x one container's wall: "
              f"{noop[1]:.1f} s / {noop[0]:.1f} s = {noop[1] / noop[0]:.2f}x "
              f"{'MET' if verdicts['no-change wall'] else 'MISSED'}")
    return {"per_extra_container_cpu_s": slopes, "goals_met": verdicts}


def print_probe(probe: dict) -> None:
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
             f"ansible all {probe['containers_pinged']} CTs -m ping (forks {sidebyside.THIS_TREE.forks})"),
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


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32],
                        help="numbers of containers, each in a fresh sim (the first is the reference)")
    parser.add_argument("--per-node", type=int, default=4, help="containers a simulated node")
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also run this git revision's playbooks and collection, side by side")
    parser.add_argument("--no-probes", action="store_true", help="skip the connection-alone timings")
    parser.add_argument("--probe-repeats", type=int, default=3, help="repeats of each connection timing")
    parser.add_argument("--provision-sizes", type=int, nargs="+", default=[1, 8],
                        help="numbers of new containers provision.yml creates, each in a fresh sim")
    parser.add_argument("--nodes", type=int, default=2, help="simulated nodes of the provisioning sims")
    parser.add_argument("--no-provision", action="store_true", help="skip the provisioning measurement")
    parser.add_argument("--no-deploy", action="store_true", help="skip the deploy measurement")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    sizes = sorted(set(args.sizes))
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-fleet-"))
    started = time.monotonic()
    load_start = [round(x, 2) for x in os.getloadavg()]
    results, provisioned, trees, forks = [], [], [], {}
    try:
        trees = ([sidebyside.baseline(args.baseline, work)] if args.baseline else []) + [sidebyside.THIS_TREE]
        forks = {tree.label: tree.forks for tree in trees}
        for n in [] if args.no_deploy else sizes:
            nodes, _ = layout(n, args.per_node)
            print(f"{n} container(s) on {nodes} node(s): deploy.yml, no-change deploy.yml, status.yml ...",
                  flush=True)
            results.append(run_size(n, args, trees, work, probes=not args.no_probes and n == sizes[-1]))
        for n in [] if args.no_provision else sorted(set(args.provision_sizes)):
            print(f"provision.yml creating {n} container(s) ...", flush=True)
            provisioned.append(provision_size(n, args, work))
            print(f"  {provisioned[-1]['provision_s']} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    labels = [tree.label for tree in trees]
    verdict = print_tables(results, labels) if results else {}
    probe = next((r["probe"] for r in results if r["probe"]), None)
    if probe:
        print_probe(probe)
    if provisioned:
        print_provision_table(provisioned)
    print(json.dumps({
        "benchmark": "fleet", "cpus": os.cpu_count(), "loadavg_start": load_start,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "forks": forks, "per_node": args.per_node,
        "sizes": results, "provision": provisioned, **verdict,
        "total_s": round(time.monotonic() - started, 1),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
