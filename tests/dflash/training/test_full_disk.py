"""A full disk under a run (a small tmpfs as its output directory or as its log's filesystem): a
checkpoint that cannot be written is never picked and leaves nothing behind, the previous one stays,
and the run goes on saying why in status.json and its log; a run whose final checkpoint cannot be
written ends failed (exit 1), and an export of it says which step it takes and which it lacks; a log
that cannot be written loses lines, never the run."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from dflash_ops.core.config import config_from_dict
from dflash_ops.core.runtime import EventLog
from dflash_ops.run.main import run_single_process
from dflash_ops.serve.export import main as export_main
from dflash_ops.training.checkpoint import latest_checkpoint, list_checkpoints

REPO = Path(__file__).resolve().parents[3]
# One tiny checkpoint takes about 160 KiB: this holds one and the run's small files, not two.
ONE_CHECKPOINT_FS = 256 * 1024


def events(text):
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_a_checkpoint_the_disk_cannot_hold_is_never_picked_and_the_run_says_why(
        tiny_config, tmp_path, small_filesystem, capsys):
    out = small_filesystem(tmp_path / "out", ONE_CHECKPOINT_FS)
    raw = tiny_config(out, optim={"total_steps": 6},
                      run={"save_every": 2, "keep_checkpoints": 1, "log_every": 1})
    capsys.readouterr()
    assert run_single_process(config_from_dict(raw)) == 1  # steps 3-6 are in no checkpoint
    out_text, err = capsys.readouterr()
    log = events(out_text)
    assert [e["step"] for e in log if e["event"] == "checkpoint"] == [2]
    failed = [e for e in log if e["event"] == "checkpoint_failed"]
    assert sorted({e["step"] for e in failed}) == [4, 6], failed  # 6 twice: at save_every, and at the end
    assert "No space left on device" in failed[-1]["message"] and "step-00000002" in failed[-1]["message"]
    # Trained on through the failed saves, and said so.
    assert [e["step"] for e in log if e["event"] == "step"] == [1, 2, 3, 4, 5, 6]
    # The run ends failed, never "completed" over steps no checkpoint holds, and says which.
    (lost,) = [e for e in log if e["event"] == "checkpoint_lost"]
    assert (lost["step"], lost["saved_step"]) == (6, 2)
    assert "steps 3-6" in lost["message"] and "step-00000002" in lost["message"]
    assert "No space left on device" in lost["message"] and lost["message"] in err
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "failed" and status["step"] == 6 and status["stop_reason"] is None
    assert status["error"] == lost["message"]
    assert status["last_checkpoint"].endswith("step-00000002")
    assert status["checkpoint_error"] == failed[-1]["message"]
    # An export of the run takes its last complete checkpoint, names its step, and warns of the rest.
    assert export_main(["--checkpoint", str(out), "--out", str(tmp_path / "export")]) == 0
    out_text, err = capsys.readouterr()
    report = json.loads(out_text)
    assert (report["step"], report["trained_step"]) == (2, 6)
    (warning,) = events(err)
    assert warning["event"] == "warning" and "exporting step 2" in warning["message"]
    assert "trained to step 6" in warning["message"]
    # Only the complete checkpoint is there: the partial saves were removed, none is picked.
    assert [p.name for p in list_checkpoints(out)] == ["step-00000002"]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"]

    # With room again the next run resumes from it, and a good save clears the error.
    subprocess.run(["mount", "-o", "remount,size=4m", str(out)], check=True)
    raw["optim"]["total_steps"] = 8
    assert run_single_process(config_from_dict(raw)) == 0
    log = events(capsys.readouterr().out)
    assert log[0]["event"] == "resume" and log[0]["step"] == 2
    assert latest_checkpoint(out).name == "step-00000008"
    status = json.loads((out / "status.json").read_text())
    assert (status["state"], status["stop_reason"]) == ("stopped", "completed")
    assert status["checkpoint_error"] is None and status["error"] is None
    assert export_main(["--checkpoint", str(out), "--out", str(tmp_path / "export8")]) == 0
    assert "trained_step" not in json.loads(capsys.readouterr().out)


def test_a_log_that_cannot_be_written_loses_lines_and_says_so_when_it_can_again(tmp_path, small_filesystem):
    fs = small_filesystem(tmp_path / "log", 16 * 1024)
    reports = []
    with open(fs / "main.log", "a") as stream:
        log = EventLog(10, stream=stream, progress_stream=io.StringIO(), on_log_error=reports.append)
        for step in range(400):
            log.emit("step", step=step, padding="x" * 100)
        assert log.lost_lines > 0 and len(reports) == 1
        assert "the log cannot be written" in reports[0] and "No space left on device" in reports[0]
        lost = log.lost_lines
        os.truncate(fs / "main.log", 0)
        log.emit("step", step=400)
    assert reports[1:] == [None]
    lines = (fs / "main.log").read_text().splitlines()
    resumed = [json.loads(line) for line in lines if '"log_resumed"' in line]
    assert resumed and resumed[0]["lost_lines"] == lost
    assert json.loads(lines[-1])["step"] == 400


def test_a_run_whose_log_is_full_trains_to_the_end_and_status_json_says_why(
        tiny_config, tmp_path, small_filesystem):
    fs = small_filesystem(tmp_path / "log", 8 * 1024)
    (fs / "filler").write_bytes(b"x" * (8 * 1024 - 512))  # the log's disk is nearly full from the start
    out = tmp_path / "out"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(out, optim={"total_steps": 30},
                                                 run={"save_every": 10, "log_every": 1})))
    with open(fs / "main.log", "ab") as log:
        done = subprocess.run([sys.executable, "-m", "dflash_ops.train", "--config", str(config)], cwd=REPO,
                              stdout=log, stderr=log, env={**os.environ, "PYTHONPATH": str(REPO)},
                              timeout=300)
    assert done.returncode == 0
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "stopped" and status["step"] == 30
    assert "the log cannot be written" in status["log_error"] and "No space left" in status["log_error"]
    assert latest_checkpoint(out).name == "step-00000030"
