"""A run never writes over or beside another run's checkpoints: `run.resume: false` beside them is refused,
`--fresh` moves the old run aside, and pruning never deletes a checkpoint of a later step than the save."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml

from dflash_ops.core.config import ConfigError
from dflash_ops.run.main import main as train_main
from dflash_ops.training.checkpoint import list_checkpoints, move_run_aside, save_checkpoint, step_of


def write_config(path: Path, raw: dict) -> str:
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def steps(output_dir: Path) -> list[int]:
    return [step_of(p) for p in list_checkpoints(output_dir)]


def test_resume_false_beside_checkpoints_is_refused_and_fresh_moves_the_old_run_aside(tiny_config, tmp_path,
                                                                                     capsys):
    run = tmp_path / "run"
    first = write_config(tmp_path / "first.yaml", tiny_config(run, optim={"total_steps": 4},
                                                              run={"save_every": 2}))
    assert train_main(["--config", first]) == 0
    assert steps(run) == [2, 4]
    status_before = (run / "status.json").read_text()
    capsys.readouterr()

    again = write_config(tmp_path / "again.yaml", tiny_config(run, optim={"total_steps": 2},
                                                              run={"save_every": 1, "resume": False}))
    assert train_main(["--config", again]) == 2
    err = capsys.readouterr().err
    assert "run.resume" in err and str(run / "checkpoints") in err and "--fresh" in err
    assert steps(run) == [2, 4] and (run / "status.json").read_text() == status_before, "nothing was touched"

    assert train_main(["--config", again, "--fresh"]) == 0
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.previous-")]
    assert len(aside) == 1 and steps(aside[0]) == [2, 4], "the old run is kept, whole"
    assert (aside[0] / "status.json").read_text() == status_before
    assert steps(run) == [1, 2]
    assert json.loads((run / "status.json").read_text())["last_checkpoint"].endswith("step-00000002")


def test_pruning_never_deletes_a_checkpoint_of_a_later_step(tmp_path):
    state = {"w": torch.zeros(2)}

    def save(step: int) -> None:
        save_checkpoint(tmp_path, step, state, {"step": step}, "{}\n", {}, keep=3)

    for step in (30, 40, 50):
        save(step)
    for step in (10, 12):
        save(step)
    assert steps(tmp_path) == [10, 12, 30, 40, 50]
    for step in (14, 16):
        save(step)
    assert steps(tmp_path) == [12, 14, 16, 30, 40, 50], "this run's own lineage keeps its latest 3"


def test_fresh_refuses_to_move_a_live_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "status.json").write_text(json.dumps({"state": "running", "pid": os.getpid()}))
    with pytest.raises(ConfigError, match="stop it before starting afresh"):
        move_run_aside(run)
    (run / "status.json").write_text(json.dumps({"state": "stopped", "pid": os.getpid()}))
    assert move_run_aside(run).name.startswith("run.previous-") and not run.exists()
