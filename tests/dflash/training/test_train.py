"""The training loop: SIGTERM and resume, per-run step budgets, checkpoints, and learning."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from dflash_ops.core.config import config_from_dict
from dflash_ops.core.runtime import EventLog, StopSignal
from dflash_ops.data.target import load_target
from dflash_ops.run.main import main as train_main
from dflash_ops.run.main import run_single_process
from dflash_ops.training import checkpoint
from dflash_ops.training.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, load_drafter
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[3]


def events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def step_losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r["event"] == "step"}


def train_in_process(raw: dict, capsys) -> tuple[int, list[dict]]:
    capsys.readouterr()
    code = run_single_process(config_from_dict(raw))
    return code, events(capsys.readouterr().out)


def status(output_dir: Path) -> dict:
    return json.loads((output_dir / "status.json").read_text())


@pytest.mark.slow
def test_sigterm_then_resume_gives_the_uninterrupted_losses(tiny_config, tmp_path, capsys):
    total = 10
    _, reference = train_in_process(tiny_config(tmp_path / "reference", optim={"total_steps": total}), capsys)
    expected = step_losses(reference)
    assert sorted(expected) == list(range(1, total + 1))

    out = tmp_path / "interrupted"
    raw = tiny_config(out, optim={"total_steps": total}, run={"step_delay": 0.5, "save_every": 1000})
    config_path = tmp_path / "interrupted.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    proc = subprocess.Popen([sys.executable, "-m", "dflash_ops.train", "--config", str(config_path)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    seen = []
    try:
        for line in proc.stdout:
            seen.append(json.loads(line))
            if seen[-1]["event"] == "step" and seen[-1]["step"] >= 3:
                os.kill(proc.pid, signal.SIGTERM)
                break
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    seen += events(rest)
    stop = seen[-1]
    assert stop["event"] == "stop" and stop["reason"] == "signal SIGTERM"
    stopped_at = stop["step"]
    assert 3 <= stopped_at < total
    assert status(out)["state"] == "stopped" and status(out)["step"] == stopped_at
    assert latest_checkpoint(out).name == checkpoint.checkpoint_name(stopped_at)

    code, resumed = train_in_process({**raw, "run": {**raw["run"], "step_delay": 0.0}}, capsys)
    assert code == 0
    assert resumed[0] == {**resumed[0], "event": "resume", "step": stopped_at}
    losses = {**step_losses(seen), **step_losses(resumed)}
    assert sorted(step_losses(resumed)) == list(range(stopped_at + 1, total + 1))
    assert losses == expected


def test_max_steps_per_run_stops_cleanly_and_the_next_run_continues(tiny_config, tmp_path, capsys):
    raw = tiny_config(tmp_path / "run", optim={"total_steps": 6},
                      run={"max_steps_per_run": 4, "save_every": 100})
    code, first = train_in_process(raw, capsys)
    assert code == 0
    assert first[-1] == {**first[-1], "event": "stop", "reason": "max_steps_per_run", "step": 4}
    assert status(tmp_path / "run")["state"] == "stopped"
    code, second = train_in_process(raw, capsys)
    assert code == 0
    assert sorted(step_losses(second)) == [5, 6]
    assert second[-1]["reason"] == "completed"
    _, trainer_state, meta = load_checkpoint(latest_checkpoint(tmp_path / "run"))
    assert meta["step"] == 6 and trainer_state["trainer"]["step"] == 6
    assert trainer_state["trainer"]["optimizer"]["state"], "optimizer moments are saved"


def test_checkpoints_keep_the_latest_k_and_record_status(tiny_config, tmp_path, capsys):
    out = tmp_path / "run"
    code, records = train_in_process(tiny_config(out, optim={"total_steps": 12},
                                                 run={"save_every": 3, "keep_checkpoints": 2}), capsys)
    assert code == 0
    assert [p.name for p in list_checkpoints(out)] == ["step-00000009", "step-00000012"]
    assert [r["step"] for r in records if r["event"] == "checkpoint"] == [3, 6, 9, 12]
    files = sorted(p.name for p in latest_checkpoint(out).iterdir())
    assert files == ["config.yaml", "meta.json", "model.safetensors", "trainer.pt"]
    final = status(out)
    assert final["state"] == "stopped" and final["step"] == 12
    assert final["last_checkpoint"].endswith("step-00000012")
    assert set(final) >= {"loss", "accuracy", "tokens_per_s", "pid", "updated_at", "workers"}
    step = next(r for r in records if r["event"] == "step")
    assert set(step) >= {"step", "loss", "accuracy", "lr", "tokens_per_s"}


def test_load_drafter_restores_the_saved_weights(tiny_config, tiny_target, tmp_path, capsys):
    out = tmp_path / "run"
    code, _ = train_in_process(tiny_config(out, optim={"total_steps": 3}), capsys)
    assert code == 0
    drafter, layer_ids = load_drafter(latest_checkpoint(out), load_target(tiny_target))
    saved, _, meta = load_checkpoint(latest_checkpoint(out))
    assert layer_ids == meta["layer_ids"] == [2]
    assert not drafter.training
    for name, value in drafter.trainable_state_dict().items():
        assert torch.equal(value, saved[name]), name


def test_an_interrupted_save_leaves_the_previous_checkpoint(tiny_config, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    raw = tiny_config(out, optim={"total_steps": 4}, run={"save_every": 2})
    calls = {"n": 0}
    real_save = torch.save

    def save_then_die(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            real_save(obj, path, *args, **kwargs)
            raise KeyboardInterrupt("killed while saving")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run_single_process(config_from_dict(raw))
    monkeypatch.undo()
    assert [p.name for p in list_checkpoints(out)] == ["step-00000002"]
    assert any(p.name.startswith(".tmp-") for p in (out / "checkpoints").iterdir())
    code, records = train_in_process(raw, capsys)
    assert code == 0 and records[0]["event"] == "resume" and records[0]["step"] == 2
    assert not any(p.name.startswith(".tmp-") for p in (out / "checkpoints").iterdir())


def test_a_second_signal_only_sets_the_flag_again():
    stop = StopSignal().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert wait_for(lambda: stop.requested, 5, interval=0.01)
        assert stop.requested and stop.signal_name == "SIGTERM"
        started = time.monotonic()
        stop.sleep(5)
        assert time.monotonic() - started < 1
    finally:
        stop.restore()


def test_bad_data_fails_with_a_clear_message(tiny_config, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}\n')
    code = run_single_process(config_from_dict(tiny_config(tmp_path / "run", data={"path": str(data)})))
    captured = capsys.readouterr()
    assert code == 2
    assert "bad.jsonl:1: input_ids and loss_mask must be non-empty lists of equal length" in captured.err
    assert "Traceback" not in captured.err
    assert events(captured.out)[-1]["event"] == "error"
    assert status(tmp_path / "run")["state"] == "failed"


def test_an_unexpected_failure_exits_1_with_its_traceback_and_restores_the_stop_handler(
        tiny_config, tmp_path, capsys, monkeypatch):
    def broken_target(*args, **kwargs):
        raise RuntimeError("the target's weights are unreadable")

    monkeypatch.setattr("dflash_ops.run.main.load_target", broken_target)
    before = signal.getsignal(signal.SIGTERM)
    code = run_single_process(config_from_dict(tiny_config(tmp_path / "run")))
    captured = capsys.readouterr()
    assert code == 1
    assert "Traceback" in captured.err and "dflash_ops.train:" not in captured.err
    assert events(captured.out)[-1] == {**events(captured.out)[-1], "event": "error",
                                        "message": "RuntimeError: the target's weights are unreadable"}
    assert status(tmp_path / "run")["state"] == "failed"
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.slow
def test_a_few_hundred_steps_make_the_loss_fall(tiny_config, tmp_path, capsys):
    # The frozen random lm_head of a hidden-32 target gives small logits: a high lr lets the
    # drafter's final norm grow enough to make confident predictions within 300 steps.
    raw = tiny_config(tmp_path / "run", optim={"total_steps": 300, "lr": 3e-2},
                      run={"save_every": 1000}, data={"max_anchors": 16})
    code, records = train_in_process(raw, capsys)
    assert code == 0
    losses = [loss for _, loss in sorted(step_losses(records).items())]
    start, end = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert end < 0.5 * start, (start, end)
    accuracies = [r["accuracy"] for r in records if r["event"] == "step"]
    assert sum(accuracies[-10:]) / 10 > 0.8


def test_train_entry_point_rejects_a_bad_config_without_a_traceback(tiny_config, tmp_path, capsys):
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config(tmp_path / "run", model={"block_size": 1})))
    assert train_main(["--config", str(config_path)]) == 2
    err = capsys.readouterr().err
    assert "model.block_size: must be >= 2" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists(), "nothing runs, nothing is written"
    with pytest.raises(SystemExit) as help_exit:
        train_main(["--help"])
    assert help_exit.value.code == 0 and "--config" in capsys.readouterr().out


def test_train_entry_point_runs_a_config_file(tiny_config, tmp_path, capsys):
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(tiny_config(tmp_path / "run", optim={"total_steps": 2})))
    assert train_main(["--config", str(config_path)]) == 0
    records = events(capsys.readouterr().out)
    assert [r["event"] for r in records] == ["start", "step", "step", "checkpoint", "stop"]
    saved_config = (latest_checkpoint(tmp_path / "run") / "config.yaml").read_text()
    written = config_from_dict(yaml.safe_load(config_path.read_text()))
    assert config_from_dict(yaml.safe_load(saved_config)) == written


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal_and_log_lines_stay_json():
    log_lines, terminal = io.StringIO(), _Terminal()
    log = EventLog(total_steps=10, stream=log_lines, progress_stream=terminal)
    log.emit("step", step=5, loss=1.5, accuracy=float("nan"))
    log.show_progress(5, 1.5, 1000.0)
    record = json.loads(log_lines.getvalue())
    assert record == {**record, "event": "step", "step": 5, "accuracy": None}
    assert "\r[###############...............] 5/10 loss 1.5000" in terminal.getvalue()

    piped = io.StringIO()
    quiet = EventLog(total_steps=10, stream=io.StringIO(), progress_stream=piped)
    quiet.show_progress(5, 1.5, 1000.0)
    assert piped.getvalue() == ""
