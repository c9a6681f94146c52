"""optim.epochs: the run's steps from the data's size, the batch and the drafters, logged at the start,
used by the schedule, kept by a resume, and where a run of 1, 2 or 3 drafters stops."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_ops.core.config import ConfigError, config_from_dict, dump_config, load_config, with_examples
from dflash_ops.core.sections import steps_for_epochs
from dflash_ops.run.main import run_single_process
from dflash_ops.training.checkpoint import latest_checkpoint, load_checkpoint
from tests.dflash.conftest import write_dataset

REPO = Path(__file__).resolve().parents[3]
# The tiny data set (conftest: 32 examples) at batch 4, 1.5 epochs: 48 examples to see, 4 per batch.
EPOCHS = {"total_steps": None, "epochs": 1.5}
HAND_STEPS = {1: 12, 2: 6, 3: 4}  # ceil(1.5 * 32 / (4 * D)): 48/4, 48/8, 48/12


def events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def layout(drafters: int) -> dict:
    return {"device": "cpu"} if drafters == 1 else {"device": "cpu", "target_workers": 1,
                                                    "drafter_workers": drafters}


def write(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def test_total_steps_and_epochs_are_mutually_exclusive_and_epochs_must_be_positive(tiny_config, tmp_path):
    with pytest.raises(ConfigError) as both:
        config_from_dict(tiny_config(tmp_path / "run", optim={"total_steps": 20, "epochs": 6}))
    assert both.value.key == "optim.epochs"
    assert "optim.total_steps (20) and optim.epochs (6.0) are mutually exclusive" in str(both.value)
    for bad in (0, -1, float("inf")):
        with pytest.raises(ConfigError, match="optim.epochs: must be > 0"):
            config_from_dict(tiny_config(tmp_path / "run", optim={"total_steps": None, "epochs": bad}))
    neither = config_from_dict(tiny_config(tmp_path / "run", optim={"total_steps": None}))
    assert neither.total_steps == neither.optim.total_steps == 1000 and neither.optim.epochs is None


def test_the_qwen3_8b_recipe_is_valid_apart_from_its_target_and_data():
    cfg = load_config(REPO / "configs" / "qwen3-8b.yaml", check_target=False)
    m, d, o, p = cfg.model, cfg.data, cfg.optim, cfg.pipeline
    assert (m.num_draft_layers, m.block_size, m.dtype, m.loss_chunk_size) == (5, 16, "bfloat16", 512)
    assert (d.max_length, d.max_anchors, d.batch_size) == (3072, 512, 8)
    assert (o.lr, o.warmup_ratio, o.epochs, o.total_steps, cfg.gamma) == (6e-4, 0.04, 6, None, 7.0)
    assert (p.device, p.target_gpus, p.drafter_gpus) == ("cuda", [0, 1, 2], [3, 4, 5, 6, 7])
    assert cfg.drafters == 5
    assert with_examples(cfg, 800_000).total_steps == 120_000  # 6 x 800000 / (8 x 5)


def test_epochs_count_as_the_decimal_written():
    # 0.7 * 10 is 7.000000000000001 in floats: a naive ceil would take an eighth step.
    assert steps_for_epochs(0.7, 10, 1, 1) == 7
    assert steps_for_epochs(6, 800_000, 8, 3) == 200_000
    assert steps_for_epochs(6, 800_001, 8, 3) == 200_001  # 4_800_006 / 24 = 200_000.25
    assert steps_for_epochs(0.01, 3, 4, 3) == 1  # at least one step


@pytest.mark.parametrize("drafters", [1, 2, 3])
def test_load_config_derives_the_steps_of_each_layout(tiny_config, tmp_path, drafters):
    raw = tiny_config(tmp_path / "run", optim=EPOCHS, pipeline=layout(drafters))
    path = write(tmp_path / "config.yaml", raw)
    cfg = load_config(path)
    assert cfg.examples == 32 and cfg.drafters == drafters
    assert cfg.total_steps == HAND_STEPS[drafters]
    assert cfg.step_plan == {"epochs": 1.5, "examples": 32, "batch_size": 4, "drafters": drafters,
                             "total_steps": HAND_STEPS[drafters]}
    assert "examples" not in yaml.safe_load(dump_config(cfg))  # not a key of the file
    assert config_from_dict(yaml.safe_load(dump_config(cfg))) == cfg
    with pytest.raises(ConfigError, match="optim.epochs: the steps follow from data.path's size"):
        _ = load_config(path, check_target=False).total_steps  # not counted: no guess


def test_the_count_is_the_loaders_less_the_examples_min_loss_tokens_drops(tiny_config, tmp_path):
    from dflash_ops.data.examples import training_examples

    raw = tiny_config(tmp_path / "run", optim=EPOCHS, data={"min_loss_tokens": 30})
    cfg = load_config(write(tmp_path / "c.yaml", raw))
    kept = len(training_examples(cfg.data, 128))
    assert 0 < kept < 32 and cfg.examples == kept
    assert cfg.total_steps == math.ceil(1.5 * kept / 4)


def test_members_drafters_all_count(tiny_config, tmp_path):
    members = {"members": [{"drafters": 2, "targets": 1}, {"drafters": 3, "targets": 1}], "member": 1,
               "rendezvous": "ct200:29400", "target_workers": 1, "drafter_workers": 3}
    raw = tiny_config(tmp_path / "run", optim=EPOCHS, pipeline=members)
    cfg = load_config(write(tmp_path / "c.yaml", raw))
    assert cfg.drafters == 5 and cfg.total_steps == math.ceil(48 / 20) == 3


def test_a_single_process_run_stops_at_the_derived_steps_and_its_schedule_uses_them(tiny_config, tmp_path,
                                                                                    capsys):
    out = tmp_path / "run"
    raw = tiny_config(out, optim={**EPOCHS, "warmup_ratio": 0.25}, run={"save_every": 1000})
    capsys.readouterr()
    assert run_single_process(config_from_dict(raw)) == 0  # not counted on loading: the run counts
    records = events(capsys.readouterr().out)
    start = next(r for r in records if r["event"] == "start")
    assert {k: start[k] for k in ("epochs", "examples", "batch_size", "drafters", "total_steps")} == \
        {"epochs": 1.5, "examples": 32, "batch_size": 4, "drafters": 1, "total_steps": 12}
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 13)) and records[-1]["reason"] == "completed"
    # Warmup round(0.25 * 12) = 3 steps, then cosine to 0 at step 12: the 8th step's lr is 4/9 of the
    # way down, when 12 (not the default 1000) is the schedule's length.
    lr = [r["lr"] for r in steps]
    assert lr[:3] == pytest.approx([1e-3, 2e-3, 3e-3])
    assert lr[7] == pytest.approx(3e-3 * 0.5 * (1 + math.cos(math.pi * 4 / 9)))
    _, state, meta = load_checkpoint(latest_checkpoint(out))
    assert meta["step"] == 12 and meta["step_plan"]["total_steps"] == 12
    # 48 examples: 1.5 epochs, 12 batches taken
    assert state["data"] == {"epoch": 1, "cursor": 16, "num_examples": 32, "batches": 12}
    assert meta["data_position"] == state["data"]


def test_a_resume_whose_data_derives_other_steps_is_refused_and_the_same_data_resumes(
        tiny_config, tiny_dataset, tmp_path, capsys):
    out = tmp_path / "run"
    raw = tiny_config(out, optim=EPOCHS, run={"save_every": 1000, "max_steps_per_run": 5})
    assert run_single_process(config_from_dict(raw)) == 0
    assert load_checkpoint(latest_checkpoint(out))[2]["step"] == 5

    bigger = write_dataset(tmp_path / "bigger.jsonl", n_rows=40)
    capsys.readouterr()
    changed = config_from_dict({**raw, "data": {**raw["data"], "path": str(bigger)}})
    assert run_single_process(changed) == 2  # bad input: nothing trained
    error = next(r for r in events(capsys.readouterr().out) if r["event"] == "error")
    assert "optim.epochs: derives 15 steps (1.5 epochs of 40 examples, batch 4 x 1 drafters), the " \
           "checkpoint's run was 12 steps (1.5 epochs of 32 examples" in error["message"]
    # Its data order goes on over its own examples only: no optim.total_steps would resume it.
    assert "set data.path (and data.min_loss_tokens) back" in error["message"]
    assert "optim.total_steps to" not in error["message"]
    assert load_checkpoint(latest_checkpoint(out))[2]["step"] == 5

    # Another batch size: the advice's optim.total_steps trains what the 1.5 epochs have left after the
    # 20 examples of 5 steps: 28 more, ceil(28 / 8) = 4 steps of 8, to step 9 (not 12, the checkpoint's).
    wider = {**raw, "data": {**raw["data"], "batch_size": 8}}
    capsys.readouterr()
    assert run_single_process(config_from_dict(wider)) == 2
    error = next(r for r in events(capsys.readouterr().out) if r["event"] == "error")
    assert "set optim.total_steps to 9 (and optim.epochs to null)" in error["message"], error["message"]
    assert "after the 20 examples trained" in error["message"]

    unlimited = {**raw, "run": {**raw["run"], "max_steps_per_run": None}}
    assert run_single_process(config_from_dict(unlimited)) == 0
    records = events(capsys.readouterr().out)
    assert next(r for r in records if r["event"] == "resume")["step"] == 5
    assert [r["step"] for r in records if r["event"] == "step"] == list(range(6, 13))


@pytest.mark.slow
# 3 drafters under make test-reliability only (half a minute): make test keeps 2, and every layout's
# derived steps through test_load_config_derives_the_steps_of_each_layout.
@pytest.mark.parametrize("drafters", [2, pytest.param(3, marks=pytest.mark.reliability_full)])
def test_a_pipeline_of_d_drafters_takes_d_batches_a_step_and_stops_at_the_derived_steps(
        tiny_config, tmp_path, drafters):
    out = tmp_path / "run"
    config = write(tmp_path / "config.yaml", tiny_config(out, optim=EPOCHS, pipeline=layout(drafters),
                                                          run={"save_every": 1000}))
    done = subprocess.run([sys.executable, "-m", "dflash_ops.train", "--config", str(config)], cwd=REPO,
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = events(done.stdout)
    steps = HAND_STEPS[drafters]
    starts = [r for r in records if r["event"] == "start" and r["worker"].startswith("drafter")]
    assert len(starts) == drafters and all(r["total_steps"] == steps and r["drafters"] == drafters
                                           for r in starts)
    assert [r["step"] for r in records if r["event"] == "step"] == list(range(1, steps + 1))
    target = next(r for r in records if r["event"] == "stop" and r["worker"] == "target0")
    assert target["batches_sent"] == steps * drafters == 12  # 1.5 epochs of 32 in batches of 4
    _, state, _ = load_checkpoint(latest_checkpoint(out))
    assert state["trainer"]["step"] == steps
    assert state["data"] == {"epoch": 1, "cursor": 16, "num_examples": 32, "batches": 12}
