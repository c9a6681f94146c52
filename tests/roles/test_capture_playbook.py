"""capture_features.yml: the target's features captured in the container, started like a run (its own
pidfile and log) from the live release, stopped at a shard boundary, resumed by shard; then a release
that trains from the cache without the target."""

import json
import shlex

import pytest

from pvesim.fleet import Fleet
from tests.waiting import wait_for

pytestmark = [pytest.mark.sim, pytest.mark.slow]

DATA = "/root/capture-train.jsonl"  # the container's own /root
CACHE = "/root/features"
LOG = "/var/log/dflash/capture.log"
ROUNDS = 4  # the demo's rows this many times: several shards


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("capture-fleet"), nodes=1, containers=(200,))
    try:
        # The demo's data (visible in the container: its root is an overlay of this machine's).
        rows = shlex.quote(str(f.assets / "data" / "train.jsonl"))
        assert f.ct(200, f"for i in $(seq {ROUNDS}); do cat {rows}; done > {DATA}").returncode == 0
        res = f.play("deploy.yml", "-e", "dflash_fleet_start_run=false",
                     "-e", f"dflash_release_data_path={DATA}")
        assert res.rc == 0, res.messages()
        yield f
    finally:
        f.down()


def events(fleet) -> list[dict]:
    return [json.loads(line) for line in (fleet.read(200, LOG) or "").splitlines() if line.startswith("{")]


# The wait polls every 2 s here (30 s by default: a capture takes hours, this one seconds).
POLL = ("-e", "dflash_capture_poll=2")


def capture(fleet, *args):
    return fleet.play("capture_features.yml", "-e", f"dflash_capture_out={CACHE}",
                      "-e", '{"dflash_capture_args": ["--shard-mb", "1"]}', *POLL, *args)


# Under make test-reliability only: 3 min; make test keeps the capture's stop and resume
# through tests/dflash/data/test_feature_cache.py and the playbook's start through the test below.
@pytest.mark.reliability_full
def test_a_capture_stops_at_a_shard_boundary_resumes_and_a_release_trains_from_it(fleet):
    slow = {"dflash_release_environment": {"DFLASH_TEST_SHARD_DELAY_S": "3"}}  # a stop lands between shards
    res = capture(fleet, "-e", "dflash_capture_wait=false", "-e", json.dumps(slow))
    assert res.rc == 0, res.messages()
    pid = json.loads(fleet.read(200, "/var/lib/dflash/capture.pid"))["pid"]
    assert wait_for(lambda: any(e["event"] == "shard" for e in events(fleet)), timeout=180)
    res = capture(fleet, "-e", "dflash_capture_state=stopped")
    assert res.rc == 0, res.messages()
    assert not fleet.alive(200, pid)
    stopped = events(fleet)[-1]
    assert stopped["event"] == "stopped" and 0 < stopped["shards_done"] < stopped["shards"], stopped
    assert fleet.read(200, f"{CACHE}/manifest.json") is None
    res = capture(fleet, "-e", "dflash_capture_state=status")
    said = res.results("Say how far the capture got.")["ct200"]["msg"]
    assert res.rc == 0 and "ct200: capture stopped" in said and '"event": "stopped"' in said, said

    res = capture(fleet)  # started again: it writes only the shards the stop left
    assert res.rc == 0, res.messages()
    done = events(fleet)[-1]
    assert done["event"] == "captured" and done["shards_written"] == done["shards"] - stopped["shards_done"]
    manifest = json.loads(fleet.read(200, f"{CACHE}/manifest.json"))
    assert len(manifest["shards"]) == done["shards"] and manifest["dataset"]["path"] == DATA

    # A release that trains from the cache: no target computes features, the run is healthy (a step).
    res = fleet.play("deploy.yml", "-e", f"dflash_release_data_path={DATA}",
                     "-e", f"dflash_release_features_path={CACHE}")
    assert res.rc == 0, res.messages()
    config = fleet.read(200, "/opt/dflash/current/config.yaml")
    assert f"features_path: {CACHE}" in config
    status = fleet.wait_for_status(200, lambda s: s.get("step", 0) >= 2, what="two steps")
    assert status["state"] == "running"
    res = fleet.play("stop_training.yml")
    assert res.rc == 0, res.messages()


def test_a_capture_that_cannot_start_fails_with_its_log(fleet):
    res = fleet.play("capture_features.yml", "-e", "dflash_capture_out=/root/features-too-big", *POLL,
                     "-e", '{"dflash_release_environment": {"DFLASH_TEST_FREE_BYTES": "1000"}}')
    assert res.rc != 0
    assert "ended without finishing /root/features-too-big" in res.messages()
    assert "needs an estimated" in res.messages() and "1000 bytes" in res.messages()
