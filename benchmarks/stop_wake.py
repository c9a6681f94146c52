"""How long a stop takes to see the run gone: the pidfd wake-up against the 0.2 s poll of /proc, side by side.

`module_utils/run_stop.py`'s `RunStopper.stop` on a stand-in run (a session leader that exits a set time
after SIGTERM, as a trainer does once its checkpoint is written), once waking at the leader's exit (its
pidfd) and once polling /proc every `POLL_SECONDS` as before, the two taking turns. The exit delays sweep
one poll period, so the poll's phase is averaged over. What the stop reports beyond the exit delay is time
the GPUs sit idle before the idle check and the successor's start.

    python -m benchmarks.stop_wake --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from ansible_collections.dflash.ops.plugins.module_utils import run_stop
from ansible_collections.dflash.ops.plugins.module_utils.run_proc import read_stat

CHILD = ("import signal, sys, time\n"
         "delay = float(sys.argv[1])\n"
         "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(delay), sys.exit(0)))\n"
         "print('ready', flush=True)\n"
         "time.sleep(600)\n")


def stop_seconds(delay: float, wake: bool) -> float:
    """The stop's `seconds` for a leader that exits `delay` s after SIGTERM."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(delay)], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        proc.stdout.readline()
        record = {"pid": proc.pid, "pgid": proc.pid, "start_time": read_stat(proc.pid).start_time}
        stopper = run_stop.RunStopper(record)
        if not wake:  # the poll alone: no pidfd to wake on
            opened, run_stop.open_pidfd = run_stop.open_pidfd, lambda *args, **kwargs: None
        try:
            return stopper.stop(60, 10)["seconds"]
        finally:
            if not wake:
                run_stop.open_pidfd = opened
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stop_wake",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="sweeps of the exit delays")
    args = parser.parse_args(argv)
    delays = [0.3 + run_stop.POLL_SECONDS * i / 8 for i in range(8)]  # one poll period of phases
    excess = {"poll": [], "pidfd": []}
    for _ in range(args.repeats):
        for delay in delays:
            for name in excess:
                excess[name].append(stop_seconds(delay, wake=name == "pidfd") - delay)
    poll, pidfd = (statistics.mean(excess[name]) for name in ("poll", "pidfd"))
    print(f"a stop's seconds beyond the run's own exit, mean of {len(excess['poll'])} stops each: "
          f"0.2 s poll {poll:.3f} s, pidfd wake {pidfd:.3f} s ({poll - pidfd:.3f} s less GPU idle time a "
          f"restart)")
    print(json.dumps({"benchmark": "stop_wake", "poll_excess_s": round(poll, 3),
                      "pidfd_excess_s": round(pidfd, 3), "stops": len(excess["poll"]),
                      "loadavg": [round(x, 2) for x in os.getloadavg()]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
