"""status.yml's table tells a run that was stopped from one that finished, failed or died.

The table is rendered by Ansible's own templar from the reports the dflash_run role's status tasks
record; the playbook tests show the live cases (running, died after its container restarted,
stopped), these the rest.
"""

from pathlib import Path

import pytest
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

from ansible_collections.dflash.ops.plugins.modules.run_report import run_state

COLLECTION = Path(__file__).resolve().parents[2] / "ansible_collections" / "dflash" / "ops"
TEMPLATE = COLLECTION / "playbooks" / "templates" / "status_table.j2"
LOG = "\n".join(f'{{"event": "step", "step": {i}}}' for i in range(1, 9)) + '\n{"event": "crash"}\n'


def render(report):
    """The table of one container whose run_report returned `report` (run_state as the module computes it)."""
    if report:
        report = {**report, "run_state": run_state({"stalled": False, **report})}
    hostvars = {"ct200": {"proxmox_node": "pve1", "dflash_run_report": report}}
    variables = {"hostvars": hostvars, "ansible_play_hosts_all": ["ct200"]}
    templar = Templar(loader=DataLoader(), variables=variables)
    return templar.template(trust_as_template(TEMPLATE.read_text())).splitlines()


def report(state, ended, progress, log_tail=""):
    return {"state": state, "pid": 4242 if state == "running" else None, "ended": ended, "log_tail": log_tail,
            "release": "r1", "running_release": "r1", "progress": progress, "gpus": [], "gpu_error": ""}


@pytest.mark.parametrize(("state", "ended", "written", "shown"), [
    ("running", False, "running", "running"),
    ("stopped", False, "stopped", "stopped"),    # a stop removed the pidfile
    ("stopped", True, "stopped", "finished"),    # it ended by itself, cleanly
    ("stopped", True, "failed", "failed"),       # torchrun or the trainer gave up
    ("stopped", True, "running", "died"),        # killed mid-run: nobody wrote an end
    ("stopped", True, "starting", "died"),
])
def test_the_state_column(state, ended, written, shown):
    progress = {"state": written, "step": 8, "loss": 1.5,
                "last_checkpoint": "/runs/main/checkpoints/step-00000005"}
    if written == "failed":
        progress["error"] = "worker drafter0 exited with -9 (after 3 restart(s) of 3 allowed)"
    lines = render(report(state, ended, progress, LOG if ended else ""))
    row = lines[1].split()
    assert row[:4] == ["ct200", "pve1", "r1", shown]
    assert (row[5], row[10]) == ("8", "5")  # the last step and the last checkpoint's step
    extra = [line.strip() for line in lines[2:]]
    if shown in ("failed", "died"):  # the end of the log, and the error when status.json has one
        assert extra[-5:] == [f"log: {line}" for line in LOG.strip().splitlines()[-5:]]
        assert ("error: worker drafter0 exited with -9" in " ".join(extra)) == (shown == "failed")
    else:
        assert extra == []


def test_a_run_without_a_checkpoint_or_a_report():
    lines = render(report("stopped", True, {"state": "running", "step": 0}))
    assert lines[1].split()[3] == "died" and lines[1].split()[10] == "-"
    hostvars_without_report = render({})
    assert hostvars_without_report[1].split()[3] == "unreachable"


def test_a_run_that_lives_with_a_full_disk_shows_what_it_could_not_write():
    progress = {"state": "running", "step": 40, "last_checkpoint": "/runs/main/checkpoints/step-00000020",
                "checkpoint_error": "checkpoint step 40 could not be written (No space left on device)",
                "log_error": "the log cannot be written since 2026-01-01T00:00:00+00:00 (No space left)"}
    lines = [line.strip() for line in render(report("running", False, progress))]
    assert lines[1].split()[3] == "running" and lines[1].split()[10] == "20"
    assert lines[2:] == [f"checkpoint: {progress['checkpoint_error']}", f"log error: {progress['log_error']}"]


def test_a_run_its_container_s_boot_started_again_says_so_and_one_it_did_not_says_why():
    resumed = {**report("running", False, {"state": "running", "step": 12}), "started_by": "boot",
               "started_at": "2026-01-01T00:00:00+00:00"}
    lines = [line.strip() for line in render(resumed)]
    assert lines[2:] == ["resumed: started again at 2026-01-01T00:00:00+00:00 after its container's boot "
                         "(it was live when the container stopped)"]
    waiting = {**report("stopped", True, {"state": "running", "step": 12}),
               "boot": {"outcome": "gpus_busy", "time": "2026-01-01T00:00:09+00:00",
                        "msg": "not started: its GPUs are not idle after 120s (GPU 0 is busy)"}}
    lines = [line.strip() for line in render(waiting)]
    assert lines[1].split()[3] == "died"
    said = ("at boot (2026-01-01T00:00:09+00:00): not started: its GPUs are not idle after 120s "
            "(GPU 0 is busy)")
    assert said in lines
    fabric = ("not started: the GPUs' NVLink fabric is In Progress/N/A after 600s (nvidia-smi -q, Fabric "
              "State; CUDA fails with error 802 until it is Completed)")
    waiting["boot"] = {"outcome": "fabric_not_ready", "time": "2026-01-01T00:10:00+00:00", "msg": fabric}
    assert f"at boot (2026-01-01T00:10:00+00:00): {fabric}" in [line.strip() for line in render(waiting)]
    stopped = {**report("stopped", False, {"state": "stopped"}), "boot": {"outcome": "stopped", "msg": "x"}}
    assert [line for line in render(stopped)[2:] if line.strip()] == []


def test_a_running_pipeline_shows_its_balance_and_a_stopped_one_does_not():
    advice = ("targets wait 64%, drafters wait 1%: drafter-bound; 3 targets : 5 drafters of the 8 workers "
              "would train 1.67x as fast as 5:3 (a batch costs a target 0.41 s, a drafter 1.12 s)")
    progress = {"state": "running", "step": 40, "balance": {"bound": "drafter-bound", "advice": advice}}
    lines = [line.strip() for line in render(report("running", False, progress))]
    assert lines[2:] == [f"balance: {advice}"]
    lines = [line.strip() for line in render(report("stopped", False, {**progress, "state": "stopped"}))]
    assert lines[2:] == []


def test_a_regeneration_running_beside_the_run_shows_how_far_it_got():
    last = '{"event": "progress", "replica": 0, "rows": 120, "of": 800, "rows_per_s": 2.5, "eta_s": 272.0}'
    shown = {**report("running", False, {"state": "running", "step": 40}),
             "jobs": [{"name": "regenerate", "pid": 5151, "started_at": "", "last": last}]}
    lines = [line.strip() for line in render(shown)]
    assert lines[2:] == [f"regenerate: running, pid 5151; last: {last}"]
    assert [line.strip() for line in render(report("running", False, {"state": "running"}))][2:] == []


@pytest.mark.parametrize(("stalled", "age", "shown"), [(True, 1234, "stalled"), (False, 12, "running")])
def test_a_running_run_without_a_step_for_longer_than_the_window_shows_stalled(stalled, age, shown):
    progress = {"state": "running", "step": 40}
    lines = render({**report("running", False, progress), "step_age": age, "stalled": stalled})
    row = lines[1].split()
    assert lines[0].split()[6] == "step_age" and (row[3], row[5], row[6]) == (shown, "40", f"{age}s")
    extra = [line.strip() for line in lines[2:]]
    assert extra == (["stalled: live, but no step for 1234s (over dflash_status_stalled_after, 900s)"]
                     if stalled else [])
    # A run that died is said so, whatever its last step's age.
    dead = render({**report("stopped", True, progress), "step_age": age, "stalled": False})
    assert dead[1].split()[3] == "died"
