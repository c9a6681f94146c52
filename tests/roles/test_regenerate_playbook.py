"""regenerate_data.yml: the target answers a prompt set in the container, started like a run (its own
pidfile and log) from the live release; the playbook returns once every row is written, and fails
clearly when the regeneration cannot finish. A job of days: an output on a read-only mount is refused
before anything starts, a call can return once the job started, and the next one resumes a stopped job
and waits for it saying how far it got."""

import json
import shlex
from pathlib import Path

import pytest

from pvesim.fleet import Fleet
from tests.waiting import wait_for

pytestmark = [pytest.mark.sim, pytest.mark.slow]

OUT = "/root/regenerated.jsonl"
PIDFILE = "/var/lib/dflash/regenerate.pid"
BOOT_RESULT = "/var/lib/dflash/regenerate.boot-result.json"
BOOT_DEVICES = Path(__file__).parents[1] / "reliability" / "playbooks" / "boot_devices.yml"
PROMPTS = "/root/prompts.jsonl"  # the container's own /root


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("regenerate-fleet"), nodes=1, containers=(200,))
    res = f.play("deploy.yml", "-e", "dflash_fleet_start_run=false")
    assert res.rc == 0, res.messages()
    yield f
    f.down()


def long_job(fleet, name):
    """Every demo prompt in the container, answered a row at a time: (the prompts, the output, the
    playbook's -e arguments for it)."""
    lines = (fleet.assets / "data" / "prompts.jsonl").read_text().splitlines()
    text = "".join(line + "\n" for line in lines)
    assert fleet.ct(200, f"printf %s {shlex.quote(text)} > {PROMPTS}.{name}").returncode == 0
    out = f"{OUT}.{name}"
    job = ["--max-new-tokens", "24", "--batch-size", "1", "--threads", "1", "--progress-every", "1"]
    return lines, out, ["-e", f"dflash_regenerate_prompts={PROMPTS}.{name}",
                        "-e", f"dflash_regenerate_out={out}",
                        "-e", json.dumps({"dflash_regenerate_args": job})]


def test_regenerate_writes_the_targets_answers_in_the_container(fleet):
    lines = (fleet.assets / "data" / "prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(line) for line in lines[:6]]
    text = "".join(json.dumps(p) + "\n" for p in prompts)
    assert fleet.ct(200, f"printf %s {shlex.quote(text)} > {PROMPTS}").returncode == 0
    res = fleet.play("regenerate_data.yml", "-e", f"dflash_regenerate_prompts={PROMPTS}",
                     "-e", f"dflash_regenerate_out={OUT}",
                     "-e", '{"dflash_regenerate_args": ["--max-new-tokens", "8", "--threads", "1"]}')
    assert res.rc == 0, res.messages()
    rows = [json.loads(line) for line in fleet.read(200, OUT).splitlines()]
    assert len(rows) == len(prompts)
    for row in rows:
        assert len(row["input_ids"]) == len(row["loss_mask"]) and 0 < sum(row["loss_mask"]) <= 8
    # Its manifest: the demo template has no thinking toggle, so the mode recorded is null.
    manifest = json.loads(fleet.read(200, f"{OUT}.manifest.json"))
    assert manifest["enable_thinking"] is None and manifest["rows"] == len(prompts)
    # Started like a run (its own pidfile and log in the container) and over when the playbook returns.
    assert '"event": "regenerated"' in fleet.read(200, "/var/log/dflash/regenerate.log")
    assert not fleet.alive(200, json.loads(fleet.read(200, "/var/lib/dflash/regenerate.pid"))["pid"])


# Under make test-reliability only: make test keeps the same failure path of a capture that cannot start
# (test_capture_playbook.py), the same playbook shape.
@pytest.mark.reliability_full
def test_a_regeneration_that_cannot_finish_fails_with_its_log(fleet):
    res = fleet.play("regenerate_data.yml", "-e", "dflash_regenerate_prompts=/srv/missing-prompts.jsonl",
                     "-e", f"dflash_regenerate_out={OUT}.bad")
    assert res.rc != 0
    assert "ended without writing" in res.messages() and "missing-prompts.jsonl" in res.messages()


def test_the_regeneration_takes_its_thinking_mode_from_the_releases_config(fleet):
    """data.enable_thinking of the release's settings reaches the command as --enable-thinking: true is
    refused for the demo template, which has no such toggle."""
    line = (fleet.assets / "data" / "prompts.jsonl").read_text().splitlines()[0] + "\n"
    assert fleet.ct(200, f"printf %s {shlex.quote(line)} > {PROMPTS}.one").returncode == 0
    thinking = '{"dflash_release_settings": {"data": {"enable_thinking": true}}}'
    res = fleet.play("regenerate_data.yml", "-e", f"dflash_regenerate_prompts={PROMPTS}.one",
                     "-e", f"dflash_regenerate_out={OUT}.thinking", "-e", thinking)
    assert res.rc != 0
    assert "has no enable_thinking toggle" in res.messages()


def test_an_output_on_a_read_only_mount_is_refused_before_anything_starts(fleet):
    """The container's /sys is a read-only mount (as a read-only bind mount of the data is): refused by name,
    with the variable to set, and the job never starts."""
    res = fleet.play("regenerate_data.yml", "-e", f"dflash_regenerate_prompts={PROMPTS}",
                     "-e", "dflash_regenerate_out=/sys/dflash/regenerated.jsonl")
    assert res.rc != 0
    messages = res.messages()
    assert "is on /sys, mounted read-only in ct200" in messages, messages
    assert "dflash_regenerate_out" in messages
    assert "TASK [Start the regeneration" not in res.stdout


def test_a_job_that_returns_at_once_is_resumed_after_a_stop_and_waited_for_with_its_progress(fleet):
    lines, out, args = long_job(fleet, "long")
    log = "/var/log/dflash/regenerate.log"
    earlier = len(fleet.read(200, log) or "")  # the log of the jobs before this one

    def this_job():
        return (fleet.read(200, log) or "")[earlier:]

    started = fleet.play("regenerate_data.yml", *args, "-e", "dflash_regenerate_wait=false")
    assert started.rc == 0, started.messages()
    assert "The regeneration runs in ct200" in started.stdout, started.stdout[-2000:]
    pid = json.loads(fleet.read(200, "/var/lib/dflash/regenerate.pid"))["pid"]
    assert wait_for(lambda: '"event": "progress"' in this_job(), timeout=120), this_job()
    # Stopped as a stop does (SIGTERM to the job this test started): it ends between two rows, keeping them.
    assert fleet.ct(200, f"kill -TERM {pid}").returncode == 0
    assert wait_for(lambda: not fleet.alive(200, pid), timeout=60)
    stopped = [json.loads(line) for line in this_job().splitlines() if '"event": "stopped"' in line]
    assert stopped and 0 < stopped[0]["rows"] < len(lines), this_job()
    done = fleet.play("regenerate_data.yml", *args, "-e", "dflash_regenerate_poll=1")
    assert done.rc == 0, done.messages()
    assert "ct200: still waiting; last: " in done.stdout, done.stdout[-3000:]
    rows = [json.loads(line) for line in fleet.read(200, out).splitlines()]
    assert sorted(r["id"] for r in rows) == list(range(len(lines)))
    finished = json.loads(fleet.read(200, log).splitlines()[-1])
    assert finished["event"] == "regenerated" and finished["skipped_done"] == stopped[0]["rows"], finished


# Under make test-reliability only (a node's reboot, a minute or two): make test keeps the boot resumer's
# rules through tests/modules/test_run_resume.py and the job's stop and resume above. Last in the file: it
# reboots the module's node.
@pytest.mark.reliability_full
def test_a_job_live_at_a_node_reboot_starts_again_at_the_containers_boot_and_finishes(fleet):
    lines, out, args = long_job(fleet, "boot")
    assert fleet.sim.ssh(fleet.sim.node_of(200).name, "pct set 200 --onboot 1").returncode == 0
    assert fleet.play(str(BOOT_DEVICES)).rc == 0
    started = fleet.play("regenerate_data.yml", *args, "-e", "dflash_regenerate_wait=false")
    assert started.rc == 0, started.messages()
    before = json.loads(fleet.read(200, PIDFILE))
    assert wait_for(lambda: fleet.read(200, f"{out}.part-0"), timeout=120), (  # rows before the reboot
        fleet.read(200, "/var/log/dflash/regenerate.log"), fleet.read(200, f"{out}.status.json"))
    log = fleet.sim.reboot_node("pve1")
    assert "Starting CT 200" in log, log

    def booted():
        record = json.loads(fleet.read(200, PIDFILE) or "{}")
        return record if record.get("started_by") == "boot" and record.get("start_time") != before.get(
            "start_time") else None
    assert wait_for(booted, timeout=180, interval=1), fleet.read(200, BOOT_RESULT)
    result = json.loads(fleet.read(200, BOOT_RESULT))
    assert result["outcome"] == "resumed", result
    # The playbook run again waits for the job the boot started, which goes on from the rows kept.
    done = fleet.play("regenerate_data.yml", *args, "-e", "dflash_regenerate_poll=1")
    assert done.rc == 0, done.messages()
    rows = [json.loads(line) for line in fleet.read(200, out).splitlines()]
    assert sorted(r["id"] for r in rows) == list(range(len(lines)))
    finished = json.loads(fleet.read(200, "/var/log/dflash/regenerate.log").splitlines()[-1])
    assert finished["event"] == "regenerated" and finished["skipped_done"] > 0, finished
    assert json.loads(fleet.read(200, f"{out}.status.json"))["stop_reason"] == "finished"
