"""Run a command beside a CPU hog per core: the load that a shared CI machine puts on the test suite.

    python scripts/cpu_load.py [--hogs N] -- make test      # N busy loops (default: one per core)

Each hog is a Python busy loop this script starts; it stops them by their pids when the command ends
(or this script is interrupted), never by name. It prints the command's wall time and the load
average it saw, and exits with the command's status. `scripts/flaky.py` uses the same hogs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time

BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def cpu_hogs(count: int):
    """`count` busy loops for the duration of the block; yields their pids."""
    hogs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL)
            for _ in range(count)]
    try:
        yield [hog.pid for hog in hogs]
    finally:
        for hog in hogs:
            hog.send_signal(signal.SIGKILL)
        for hog in hogs:
            hog.wait()


def load_average() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/cpu_load.py",
                                     description="Run a command beside a CPU hog per core.")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 1,
                        help="busy loops beside the command (default: one per core, %(default)s)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("name the command to run after --")
    if args.hogs < 0:
        parser.error("--hogs must be >= 0")
    started = time.monotonic()
    with cpu_hogs(args.hogs) as pids:
        print(f"cpu_load: {args.hogs} hog(s) {pids}; load {load_average()}; running {' '.join(command)}",
              flush=True)
        status = subprocess.call(command)
        seen = load_average()
    minutes, seconds = divmod(round(time.monotonic() - started), 60)
    print(f"cpu_load: exit {status} after {minutes}:{seconds:02d} beside {args.hogs} hog(s); load at the end "
          f"{seen} (1, 5, 15 min)", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
