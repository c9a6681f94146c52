"""End to end: a real Prometheus (Debian's binary, on loopback) scrapes the node_exporter that provision.yml
set up in a pvesim container, whose run deploy.yml started with its metrics on; the run frozen (SIGSTOP of
its process group, the single-process run's one worker), the collection's stalled-run alert is `firing` in
Prometheus's /api/v1/alerts within its window, and gone once the run goes on (SIGCONT).

The rules are the shipped file's, the stall's threshold and `for:` shortened to the test's seconds (the
only change, asserted). Runs under `make test-prometheus` (-m prometheus), not in a plain make test, whose
fast case is tests/prometheus/test_rules.py and tests/dflash/run/test_metrics_textfile.py."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from pvesim.fleet import Fleet
from tests.prometheus.test_rules import RULES
from tests.prometheus.tools import prometheus_program
from tests.waiting import wait_for

pytestmark = [pytest.mark.sim, pytest.mark.slow, pytest.mark.prometheus]

STALL_S = 30  # the shipped rule's 600 s: a sim run steps every 2 s, a loaded machine slower
FOR_S = 5  # the shipped rule's 5m
SCRAPE_S = 1
LABELS = {"container": "ct200", "node": "pve1", "run": "main", "member": "0"}


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def shortened_rules(dest):
    rules = yaml.safe_load(RULES.read_text())
    stalled = next(r for g in rules["groups"] for r in g["rules"] if r["alert"] == "DFlashRunStalled")
    assert "> 600)" in stalled["expr"] and stalled["for"] == "5m", stalled
    stalled["expr"] = stalled["expr"].replace("> 600)", f"> {STALL_S})")
    stalled["for"] = f"{FOR_S}s"
    dest.write_text(yaml.safe_dump(rules, sort_keys=False))
    return dest


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("prometheus-fleet"), nodes=1, containers=(200,), network="loopback")
    try:
        address = f.sim.address_of(200)
        target = f"{address}:{free_port(address)}"
        on = ["-e", "dflash_run_metrics_textfile=true",
              "-e", f"proxmox_provision_node_exporter_listen={target}"]
        res = f.play("provision.yml", "-l", "ct200", *on)
        assert res.rc == 0, res
        res = f.play("deploy.yml", *on)
        assert res.rc == 0, res
        yield f, target
    finally:
        f.down()


@pytest.fixture(scope="module")
def prometheus(fleet, tmp_path_factory):
    _, target = fleet
    binary = prometheus_program("prometheus")
    base = tmp_path_factory.mktemp("prometheus")
    config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
              "rule_files": [str(shortened_rules(base / "dflash.rules.yml"))],
              "scrape_configs": [{"job_name": "dflash", "static_configs": [{"targets": [target]}]}]}
    (base / "prometheus.yml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    with open(base / "prometheus.log", "wb") as log:
        proc = subprocess.Popen([binary, f"--config.file={base / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={base / 'data'}", f"--web.listen-address={url[7:]}"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        assert wait_for(lambda: get(url, "/-/ready") is not None, timeout=60, interval=0.5), \
            (base / "prometheus.log").read_text()[-3000:]
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def get(url: str, path: str):
    try:
        with urllib.request.urlopen(url + path, timeout=5) as response:
            body = response.read()
    except OSError:
        return None
    return json.loads(body) if path.startswith("/api/") else body


def stalled(url: str) -> list[dict]:
    alerts = (get(url, "/api/v1/alerts") or {}).get("data", {}).get("alerts", [])
    return [a for a in alerts if a["labels"].get("alertname") == "DFlashRunStalled"]


def running_series(url: str) -> list[dict]:
    query = urllib.parse.quote('dflash_run_state{state="running"} == 1')
    return (get(url, f"/api/v1/query?query={query}") or {}).get("data", {}).get("result", [])


def test_a_frozen_run_fires_the_stalled_alert_and_it_resolves_when_the_run_goes_on(fleet, prometheus):
    f, _ = fleet
    seen = wait_for(lambda: running_series(prometheus), timeout=180, interval=1)
    assert seen, "Prometheus scrapes no running run"
    assert LABELS.items() <= seen[0]["metric"].items(), seen
    assert not [a for a in stalled(prometheus) if a["state"] == "firing"]
    run = f.run_info(200)
    assert f.ct(200, f"kill -STOP -{run['pgid']}").returncode == 0
    frozen = time.monotonic()
    try:
        firing = wait_for(lambda: [a for a in stalled(prometheus) if a["state"] == "firing"],
                          timeout=STALL_S + FOR_S + 30, interval=0.5)
        waited = time.monotonic() - frozen
        assert firing, f"no firing DFlashRunStalled {waited:.0f} s after the freeze: {stalled(prometheus)}"
        assert LABELS.items() <= firing[0]["labels"].items() and firing[0]["labels"]["severity"] == "critical"
        print(f"DFlashRunStalled firing {waited:.1f} s after the freeze (window {STALL_S} s + for {FOR_S} s)")
    finally:
        assert f.ct(200, f"kill -CONT -{run['pgid']}").returncode == 0
    thawed = time.monotonic()
    assert wait_for(lambda: not stalled(prometheus), timeout=60, interval=0.5), stalled(prometheus)
    print(f"resolved {time.monotonic() - thawed:.1f} s after SIGCONT")
