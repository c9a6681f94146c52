"""A run across containers: pipeline tokens/s with two members (two torchruns joined by a c10d
rendezvous, as two containers run them) against one, measured side by side in one run on CPU.

- (a) one member, 1 target + 1 drafter worker;
- (b) one member, 2 targets + 2 drafters;
- (c) two members of 1 target + 1 drafter each, as processes on 127.0.0.1 (what two containers on
  the sim's loopback network are, without the containers).

(c)/(a) is "two containers against one": on a machine where each member brings its own cores it
would approach 2 (twice the workers, a batch per drafter per step); on this machine all members
share the same cores, so it says what they cost each other. (c)/(b) compares the same four workers
in one member and across two: the cost of the cross-member rendezvous and transport (1.0 is none).
Each configuration runs `--repeats` times, interleaved; the fastest counts. Rates are steady-state
(`benchmarks.pipeline.steady_rate`), so start-up and rendezvous are left out; their wall times are shown.

Prints a table, then, as its last line, one JSON object with every figure.

    python -m benchmarks.members                 # small sizes, a few minutes on 2 cores
    python -m benchmarks.members --steps 40 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.pipeline import REPO, build_assets, steady_rate

MEMBER = {"target_workers": 1, "drafter_workers": 1}


def write(work: Path, name: str, base: dict, pipeline: dict) -> Path:
    config = json.loads(json.dumps(base))
    config["run"]["output_dir"] = str(work / f"run-{name}")
    config["pipeline"].update(pipeline)
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_members(configs: list[Path], tokens_per_step: int, warmup: int) -> dict:
    """Start every member's `python -m dflash_ops.train` at once; member 0's step events give the rate.
    Output goes to files: a member blocked on a full pipe would stall the others' collectives."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    logs = [(c.with_suffix(".out"), c.with_suffix(".err")) for c in configs]
    started = time.monotonic()
    procs = []
    for config, (out, err) in zip(configs, logs, strict=True):
        with out.open("w") as stdout, err.open("w") as stderr:
            command = [sys.executable, "-m", "dflash_ops.train", "--config", str(config)]
            procs.append(subprocess.Popen(command, cwd=REPO, env=env, stdout=stdout, stderr=stderr,
                                          start_new_session=True))
    for proc in procs:
        proc.wait()
    wall = time.monotonic() - started
    for config, proc, (_, err) in zip(configs, procs, logs, strict=True):
        if proc.returncode != 0:
            raise SystemExit(f"{config.name} failed ({proc.returncode}):\n{err.read_text()[-3000:]}")
    return {**steady_rate(configs[0].name, logs[0][0].read_text(), tokens_per_step, warmup), "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.members", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (20)")
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of the steady-state rate (4)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per drafter step (4)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (128)")
    parser.add_argument("--hidden", type=int, default=128, help="target hidden size (128)")
    parser.add_argument("--target-layers", type=int, default=4, help="target depth (4)")
    parser.add_argument("--max-anchors", type=int, default=4, help="anchors per sequence (4)")
    parser.add_argument("--block-size", type=int, default=8, help="drafter block size (8)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary size (1024)")
    parser.add_argument("--queue-depth", type=int, default=4, help="batches in flight per drafter (4)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration, interleaved (1)")
    args = parser.parse_args(argv)
    if args.steps - args.warmup < 2 or args.repeats < 1:
        parser.error("--steps must exceed --warmup by 2 or more, --repeats >= 1")

    tokens_per_step = args.batch_size * args.seq_len  # per drafter
    with tempfile.TemporaryDirectory(prefix="dflash-bench-members-") as tmp:
        work = Path(tmp)
        base = yaml.safe_load(build_assets(work, args).read_text())
        one = write(work, "one", base, MEMBER)
        one_wide = write(work, "one-2x2", base, {"target_workers": 2, "drafter_workers": 2})
        runs: dict[str, list[dict]] = {"one": [], "one_2x2": [], "two": []}
        for repeat in range(args.repeats):
            runs["one"].append(run_members([one], tokens_per_step, args.warmup))
            runs["one_2x2"].append(run_members([one_wide], 2 * tokens_per_step, args.warmup))
            endpoint = f"127.0.0.1:{free_port()}"
            members = [write(work, f"two-{repeat}-{i}", base, {
                **MEMBER, "members": [{"drafters": 1, "targets": 1}] * 2, "member": i,
                "rendezvous": endpoint, "address": "127.0.0.1"}) for i in range(2)]
            runs["two"].append(run_members(members, 2 * tokens_per_step, args.warmup))
        best = {name: max(rs, key=lambda r: r["tokens_per_s"]) for name, rs in runs.items()}

    figures = {
        "benchmark": "members",
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),  # other work on the machine skews every rate
        "sizes": {k: getattr(args, k) for k in ("steps", "warmup", "batch_size", "seq_len", "hidden",
                                                 "target_layers", "max_anchors", "repeats")},
        **{f"{name}_tokens_per_s": round(r["tokens_per_s"], 1) for name, r in best.items()},
        **{f"{name}_wall_s": round(r["wall_s"], 1) for name, r in best.items()},
        "two_members_vs_one": round(best["two"]["tokens_per_s"] / best["one"]["tokens_per_s"], 3),
        "two_members_vs_one_member_2x2":
            round(best["two"]["tokens_per_s"] / best["one_2x2"]["tokens_per_s"], 3),
    }
    print(f"{'configuration':<34} {'tokens/s':>10} {'wall s':>8}")
    for label, name in (("(a) 1 member, 1 + 1", "one"), ("(b) 1 member, 2 + 2", "one_2x2"),
                        ("(c) 2 members, 1 + 1 each", "two")):
        print(f"{label:<34} {best[name]['tokens_per_s']:>10.1f} {best[name]['wall_s']:>8.1f}")
    print(f"(c)/(a) {figures['two_members_vs_one']}   (c)/(b) {figures['two_members_vs_one_member_2x2']}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
