"""The collection's alerting rules (files/prometheus/dflash.rules.yml): Prometheus's own checker accepts them
and each alert fires, and stays quiet, where tests/prometheus/dflash.rules.test.yml says (`promtool test
rules`, Debian's prometheus package, which make setup installs)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.prometheus.tools import prometheus_program

HERE = Path(__file__).parent
RULES = HERE.parents[1] / "ansible_collections/dflash/ops/files/prometheus/dflash.rules.yml"
ALERTS = {"DFlashRunStalled", "DFlashRunDied", "DFlashTorchrunRestartLoop", "DFlashGPUsIdle",
          "DFlashCheckpointStale", "DFlashOutputDiskFull"}


def promtool(*args: str) -> subprocess.CompletedProcess:
    tool = prometheus_program("promtool")
    return subprocess.run([tool, *args], cwd=HERE, capture_output=True, text=True, timeout=120)


def test_the_rules_file_is_valid_and_names_every_alert():
    check = promtool("check", "rules", str(RULES))
    assert check.returncode == 0, check.stdout + check.stderr
    rules = [r for group in yaml.safe_load(RULES.read_text())["groups"] for r in group["rules"]]
    assert {r["alert"] for r in rules} == ALERTS


def test_each_alert_fires_where_its_unit_test_says():
    tests = yaml.safe_load((HERE / "dflash.rules.test.yml").read_text())["tests"]
    tested = {case["alertname"] for t in tests for case in t["alert_rule_test"] if case["exp_alerts"]}
    assert tested == ALERTS  # each alert has a case where it fires
    result = promtool("test", "rules", "dflash.rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
