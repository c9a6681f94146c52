"""status.json follows the run's log, line by line, in either layout (dflash_ops.run.status)."""

from __future__ import annotations

import json

from dflash_ops.run.status import RunStatus


def follow(status: RunStatus, *records: dict) -> dict:
    for record in records:
        status.follow(record)
    return json.loads(status.file.path.read_text())


def test_a_pipeline_stop_turns_the_run_and_its_workers_stopping_then_stopped(tmp_path):
    status = RunStatus(tmp_path)
    shown = follow(status, {"event": "launch", "pid": 10},
                   {"event": "worker_start", "worker": "drafter0", "pid": 11, "gpus": [5]},
                   {"event": "worker_start", "worker": "target0", "pid": 12, "gpus": [0]},
                   {"event": "start", "worker": "drafter0"},
                   {"event": "step", "worker": "drafter0", "step": 3, "loss": 2.5, "accuracy": 0.25,
                    "tokens_per_s": 900.0})
    assert (shown["state"], shown["step"], shown["loss"]) == ("running", 3, 2.5)
    assert shown["workers"] == {"drafter0": {"state": "running", "pid": 11, "gpus": [5]},
                                "target0": {"state": "starting", "pid": 12, "gpus": [0]}}

    shown = follow(status, {"event": "stop", "worker": "launcher", "reason": "signal"},
                   {"event": "checkpoint", "worker": "drafter0", "step": 4, "path": "/run/step-00000004"},
                   {"event": "stop", "worker": "drafter0", "step": 4})
    assert (shown["state"], shown["step"], shown["last_checkpoint"]) == ("stopping", 4, "/run/step-00000004")
    states = {name: worker["state"] for name, worker in shown["workers"].items()}
    assert states == {"drafter0": "stopped", "target0": "stopping"}

    shown = follow(status, {"event": "worker_exit", "worker": "drafter0", "returncode": 0},
                   {"event": "worker_exit", "worker": "target0", "returncode": 0},
                   {"event": "exit", "returncode": 0, "restarts": 0})
    assert shown["state"] == "stopped" and shown["error"] is None
    assert {w["state"] for w in shown["workers"].values()} == {"exited"}


def test_a_restart_starts_a_new_workers_table_and_a_failure_keeps_its_error(tmp_path):
    status = RunStatus(tmp_path)
    shown = follow(status, {"event": "launch"}, {"event": "worker_start", "worker": "drafter0", "pid": 11},
                   {"event": "error", "worker": "drafter0", "message": "peer lost"},  # not the run's own
                   {"event": "restart", "restart": 1, "cause": "worker target0 was killed by SIGKILL"},
                   {"event": "worker_start", "worker": "drafter0", "pid": 21})
    assert (shown["state"], shown["restarts"], shown["error"]) == ("starting", 1, None)
    assert shown["workers"] == {"drafter0": {"state": "starting", "pid": 21, "gpus": []}}
    shown = follow(status, {"event": "error", "message": "worker drafter0 (pid 21) failed: boom"},
                   {"event": "exit", "returncode": 1, "error": "worker drafter0 (pid 21) failed: boom"})
    assert (shown["state"], shown["error"]) == ("failed", "worker drafter0 (pid 21) failed: boom")


def test_a_single_process_names_itself_and_stops_with_its_stop_event(tmp_path):
    status = RunStatus(tmp_path, process_worker="trainer")
    assert json.loads(status.file.path.read_text())["workers"]["trainer"]["state"] == "starting"
    shown = follow(status, {"event": "start", "step": 0},
                   {"event": "stop", "step": 7, "reason": "signal SIGTERM"})
    assert (shown["state"], shown["step"], shown["workers"]["trainer"]["state"]) == ("stopped", 7, "stopped")



def test_a_start_that_resumes_keeps_the_old_runs_step_and_checkpoint_even_when_it_fails(tmp_path):
    checkpoint = tmp_path / "step-00000004"
    checkpoint.mkdir()
    follow(RunStatus(tmp_path), {"event": "launch"},
           {"event": "checkpoint", "worker": "drafter0", "step": 4, "path": str(checkpoint)},
           {"event": "heldout", "worker": "drafter0", "heldout_loss": 1.5, "heldout_tau": 2.25},
           {"event": "exit", "returncode": 0})

    status = RunStatus(tmp_path)  # the next start resumes step 4: it shows it while it loads
    shown = follow(status, {"event": "launch"}, {"event": "worker_start", "worker": "drafter0", "pid": 21})
    assert (shown["state"], shown["step"], shown["last_checkpoint"]) == ("starting", 4, str(checkpoint))
    shown = follow(status, {"event": "error", "message": "worker drafter0 (pid 21) failed: boom"},
                   {"event": "exit", "returncode": 1, "error": "boom"})
    assert (shown["state"], shown["error"], shown["step"]) == ("failed", "boom", 4)
    assert (shown["last_checkpoint"], shown["heldout_tau"]) == (str(checkpoint), 2.25)

    checkpoint.rmdir()  # a status.json whose checkpoint is gone: the start is a run of its own
    shown = follow(RunStatus(tmp_path), {"event": "launch"})
    assert (shown["step"], shown["last_checkpoint"], shown["heldout_tau"]) == (0, None, None)


def test_a_checkpoint_written_on_a_thread_and_logged_after_later_steps_never_moves_the_step_back(tmp_path):
    shown = follow(RunStatus(tmp_path, process_worker="trainer"), {"event": "start", "step": 0},
                   {"event": "step", "step": 10, "loss": 2.0}, {"event": "step", "step": 11, "loss": 1.9},
                   {"event": "checkpoint", "step": 10, "path": "/run/step-00000010"})
    assert (shown["step"], shown["last_checkpoint"]) == (11, "/run/step-00000010")
