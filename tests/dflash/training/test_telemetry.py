"""What a run shows: interval means, grad norm, per-position accuracy, held-out figures in the log,
metrics.jsonl, TensorBoard event files and status.json; the ETA on a terminal; the PNG curves."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest

from dflash_ops.core.config import config_from_dict
from dflash_ops.core.runtime import EventLog
from dflash_ops.run.main import run_single_process
from dflash_ops.training.plots import main as plots_main
from dflash_ops.training.telemetry import METRICS_FILE, TENSORBOARD_DIR, IntervalMeter, RunTelemetry
from dflash_ops.training.trainer import StepResult


def run_records(raw: dict, capsys) -> list[dict]:
    capsys.readouterr()
    assert run_single_process(config_from_dict(raw)) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


@pytest.fixture
def heldout_config(tiny_config, tiny_eval_dataset, tmp_path):
    def make(name: str, **sections) -> dict:
        raw = tiny_config(tmp_path / name, **sections)
        raw["data"].update(eval_path=str(tiny_eval_dataset), eval_examples=3)
        return raw

    return make


def test_logged_figures_are_means_over_the_interval(heldout_config, capsys):
    every_step = run_records(heldout_config("each", optim={"total_steps": 6}, run={"log_every": 1}), capsys)
    grouped = run_records(heldout_config("grouped", optim={"total_steps": 6}, run={"log_every": 3}), capsys)
    each = {r["step"]: r for r in every_step if r["event"] == "step"}
    lines = [r for r in grouped if r["event"] == "step"]
    assert [r["step"] for r in lines] == [3, 6] and all(r["interval_steps"] == 3 for r in lines)
    for line in lines:
        steps = range(line["step"] - 2, line["step"] + 1)
        assert line["loss"] == pytest.approx(sum(each[s]["loss"] for s in steps) / 3, rel=1e-6)
        assert line["grad_norm"] == pytest.approx(sum(each[s]["grad_norm"] for s in steps) / 3, rel=1e-6)
        assert line["grad_norm_max"] == pytest.approx(max(each[s]["grad_norm"] for s in steps), rel=1e-6)
        assert line["samples_per_s"] > 0  # the step line carries it: a pipeline's progress line shows it
    first = each[1]
    # Block size 4: accuracy at draft positions 1..3, each a fraction; the overall one lies among them.
    assert len(first["accuracy_by_position"]) == 3
    assert all(0.0 <= a <= 1.0 for a in first["accuracy_by_position"])
    assert min(first["accuracy_by_position"]) <= first["accuracy"] <= max(first["accuracy_by_position"])
    assert first["grad_norm"] > 0 and math.isfinite(first["grad_norm"])


def test_heldout_figures_reach_the_log_metrics_tensorboard_and_status(heldout_config, tmp_path, capsys):
    raw = heldout_config("run", optim={"total_steps": 5}, run={"eval_every": 2, "log_every": 1})
    records = run_records(raw, capsys)
    heldout = [r for r in records if r["event"] == "heldout"]
    assert [r["step"] for r in heldout] == [2, 4, 5]  # every 2 steps and at the end
    for r in heldout:
        assert 1.0 <= r["heldout_tau"] <= 4.0 and r["heldout_loss"] > 0
        assert len(r["heldout_acceptance_by_position"]) == 3

    out = tmp_path / "run"
    metrics = [json.loads(line) for line in (out / METRICS_FILE).read_text().splitlines()]
    assert [m["step"] for m in metrics if m["kind"] == "train"] == [1, 2, 3, 4, 5]
    heldout_taus = [r["heldout_tau"] for r in heldout]
    assert [m["heldout_tau"] for m in metrics if m["kind"] == "heldout"] == heldout_taus
    status = json.loads((out / "status.json").read_text())
    assert status["heldout_tau"] == heldout[-1]["heldout_tau"]
    assert status["heldout_loss"] == pytest.approx(heldout[-1]["heldout_loss"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / TENSORBOARD_DIR))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5]
    assert [round(e.value, 4) for e in events.Scalars("heldout/heldout_tau")] == \
        [round(r["heldout_tau"], 4) for r in heldout]
    assert "train/accuracy_by_position/1" in events.Tags()["scalars"]


def test_plots_write_loss_and_tau_curves(heldout_config, tmp_path, capsys):
    run_records(heldout_config("run", optim={"total_steps": 4}, run={"eval_every": 2}), capsys)
    out_dir = tmp_path / "plots"
    assert plots_main([str(tmp_path / "run"), "--out", str(out_dir)]) == 0
    for name in ("loss.png", "tau.png"):
        data = (out_dir / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 1000
    assert plots_main([str(tmp_path / "nowhere"), "--out", str(out_dir)]) == 2
    assert "no metrics" in capsys.readouterr().err


def test_without_tensorboard_the_run_warns_once_and_keeps_metrics(heldout_config, tmp_path, capsys,
                                                                   monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # the import fails
    records = run_records(heldout_config("run", optim={"total_steps": 3}), capsys)
    warnings = [r for r in records if r["event"] == "warning"]
    assert len(warnings) == 1 and "no TensorBoard event files" in warnings[0]["message"]
    assert records[-1]["event"] == "stop"
    assert len((tmp_path / "run" / METRICS_FILE).read_text().splitlines()) == 3 + 1  # 3 steps, 1 held-out
    assert not (tmp_path / "run" / TENSORBOARD_DIR).exists()


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True



def test_the_interval_s_throughput_is_its_rows_and_tokens_over_its_seconds():
    meter = IntervalMeter()
    for step, seconds in ((1, 1.5), (2, 2.5)):  # 2 steps of a global batch of 8 rows, 100 tokens each
        meter.add(StepResult(step=step, loss=1.0, accuracy=0.5, lr=1e-3, num_tokens=100, num_blocks=4,
                             grad_norm=1.0, position_hits=[0, 1], position_counts=[0, 2]), seconds, samples=8)
    figures = meter.flush()
    assert (figures["samples_per_s"], figures["tokens_per_s"], figures["interval_steps"]) == (4.0, 50.0, 2)


def test_progress_line_shows_step_total_and_an_eta(monkeypatch):
    clock = iter([100.0, 110.0])
    monkeypatch.setattr("dflash_ops.core.runtime.time.monotonic", lambda: next(clock))
    terminal = _Terminal()
    log = EventLog(total_steps=100, stream=io.StringIO(), progress_stream=terminal)
    log.show_progress(10, 2.0, 500.0)   # the pace starts here: no ETA yet
    log.show_progress(20, 1.5, 500.0)   # 10 steps in 10 s, 80 to go
    first, second = terminal.getvalue().split("\r")[1:]
    assert " 10/100 " in first and "ETA --" in first
    assert " 20/100 " in second and "ETA 1m20s" in second


def test_progress_line_shows_the_latest_heldout_tau_and_samples_per_second():
    terminal = _Terminal()
    log = EventLog(total_steps=100, stream=io.StringIO(), progress_stream=terminal)
    log.show_progress(10, 2.0, 500.0, samples_per_s=12.5)
    assert "tau" not in terminal.getvalue() and "12.5 samples/s" in terminal.getvalue()
    log.emit("heldout", step=10, heldout_tau=3.214)
    log.show_progress(11, 1.9, 500.0, samples_per_s=12.5)
    assert "11/100 loss 1.9000 tau 3.21 12.5 samples/s 500 tok/s" in terminal.getvalue().split("\r")[-1]


def strict_json(line: str) -> dict:
    """`line` read as strict JSON: NaN and Infinity are not JSON."""
    def refuse(constant: str):
        raise ValueError(f"{constant} in a JSON line: {line}")

    return json.loads(line, parse_constant=refuse)


def test_no_nan_anywhere_in_a_log_line_or_a_metrics_line(tmp_path):
    figures = {"loss": math.nan, "accuracy_by_position": [math.nan, 0.5, math.inf],
               "nested": {"tau": math.nan}}
    stream = io.StringIO()
    EventLog(total_steps=1, stream=stream).emit("step", step=1, **figures)
    logged = strict_json(stream.getvalue())
    assert logged["loss"] is None and logged["accuracy_by_position"] == [None, 0.5, None]
    assert logged["nested"] == {"tau": None}
    telemetry = RunTelemetry(tmp_path, enabled=True, warn=print)
    telemetry.record("train", 1, figures)
    telemetry.close()
    metrics = strict_json((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["accuracy_by_position"] == [None, 0.5, None]
