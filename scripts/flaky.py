"""Rerun named tests many times under load and report each one's failure rate (`make test-flaky`).

    python scripts/flaky.py TEST [TEST ...] [--runs 20] [--hogs N] [--workers 2]
    make test-flaky TEST=tests/modules/test_run_report.py RUNS=50

A race that a quiet machine hides shows under load: the tests run `--runs` times each (pytest-repeat's
`--count`) on `--workers` xdist workers, beside a CPU hog per core (`scripts/cpu_load.py`), and the
report gives, per test, the runs, the failures and the rate, with the first failure's message.
It exits 1 when any run failed: a test that fails once under load is a bug to fix, not to rerun.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_load import cpu_hogs, load_average  # noqa: E402

# pytest-repeat's suffix: `test[3-20]`, or `test[param-3-20]` for a parametrized test.
REPEAT_SUFFIX = re.compile(r"(\[|-)\d+-\d+\]$")


def base_name(name: str) -> str:
    """A repeated test's name without pytest-repeat's run number."""
    match = REPEAT_SUFFIX.search(name)
    if not match:
        return name
    return name[: match.start()] + ("]" if match.group(1) == "-" else "")


def tally(junit: Path) -> dict[str, dict]:
    """Per test: runs, failures (failed or errored), skips and the first failure's message."""
    counts: dict[str, dict] = defaultdict(lambda: {"runs": 0, "failed": 0, "skipped": 0, "first": ""})
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{base_name(case.get('name', ''))}"
        entry = counts[test]
        entry["runs"] += 1
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            entry["failed"] += 1
            entry["first"] = entry["first"] or (problem.get("message") or "").splitlines()[0][:200]
        elif case.find("skipped") is not None:
            entry["skipped"] += 1
    return dict(counts)


def report(counts: dict[str, dict]) -> str:
    lines = [f"{'runs':>5} {'failed':>6} {'rate':>6}  test"]
    for test, entry in sorted(counts.items()):
        ran = entry["runs"] - entry["skipped"]
        rate = f"{100 * entry['failed'] / ran:.1f}%" if ran else "-"
        lines.append(f"{entry['runs']:>5} {entry['failed']:>6} {rate:>6}  {test}"
                     + (f" ({entry['skipped']} skipped)" if entry["skipped"] else ""))
        if entry["first"]:
            lines.append(f"{'':>20}first failure: {entry['first']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/flaky.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", nargs="+", help="pytest node ids or files")
    parser.add_argument("--runs", type=int, default=20, help="runs of each test (default %(default)s)")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 1,
                        help="CPU hogs beside the runs (default: one per core, %(default)s; 0 for none)")
    parser.add_argument("--workers", type=int, default=2, help="xdist workers (default %(default)s)")
    args = parser.parse_args(argv)
    if args.runs < 1 or args.workers < 1 or args.hogs < 0:
        parser.error("--runs and --workers must be >= 1, --hogs >= 0")
    with tempfile.TemporaryDirectory(prefix="flaky-") as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", *args.tests, "--count", str(args.runs),
                   "-n", str(args.workers), "--dist", "load", "-q", "-p", "no:cacheprovider",
                   f"--junitxml={junit}"]
        with cpu_hogs(args.hogs):
            print(f"flaky: {args.runs} run(s) of {' '.join(args.tests)} on {args.workers} worker(s) beside "
                  f"{args.hogs} hog(s)", flush=True)
            status = subprocess.call(command, stdout=subprocess.DEVNULL)
            seen = load_average()
        if not junit.exists():
            print(f"flaky: pytest wrote no report (exit {status}): check the test ids", file=sys.stderr)
            return 2
        counts = tally(junit)
    print(report(counts))
    print(f"load at the end: {seen} (1, 5, 15 min)")
    return 1 if any(entry["failed"] for entry in counts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
