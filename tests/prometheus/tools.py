"""Prometheus's own programs for the tests: Debian's prometheus package, unpacked by `make prometheus-tools`
into .cache/prometheus (never installed, which would start a Prometheus on the machine), else on PATH."""

from __future__ import annotations

import shutil
from pathlib import Path

UNPACKED = Path(__file__).resolve().parents[2] / ".cache" / "prometheus" / "usr" / "bin"


def prometheus_program(name: str) -> str:
    """The path of `promtool` or `prometheus`; fails the test naming the make target when neither is there."""
    unpacked = UNPACKED / name
    found = str(unpacked) if unpacked.is_file() else shutil.which(name)
    assert found, f"{name} is missing: `make prometheus-tools` unpacks it into .cache/prometheus"
    return found
