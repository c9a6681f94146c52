"""`dflash_ops.evaluate` as users expect it: the held-out rows of data.eval_path, a checkpoint or an export,
the checkpoint's own config when --config is absent, and one clear line for a drafter of another target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflash_ops.run.main import main as train_main
from dflash_ops.serve.evaluate import main as evaluate_main
from dflash_ops.serve.export import export_checkpoint
from dflash_ops.training.checkpoint import latest_checkpoint

QUICK = ["--num-prompts", "2", "--max-new-tokens", "4", "--no-target-row", "--json"]


@pytest.fixture
def trained(tiny_config, tiny_eval_dataset, tmp_path, capsys) -> tuple[Path, Path]:
    """(the config file, the run's output dir) of a 2-step run whose held-out rows are not beside its data."""
    raw = tiny_config(tmp_path / "run", optim={"total_steps": 2}, data={"eval_path": str(tiny_eval_dataset)})
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    assert train_main([str(config)]) == 0
    capsys.readouterr()
    return config, tmp_path / "run"


def taus(out: str) -> dict[str, float]:
    return {row["name"]: row["tau"] for row in json.loads(out)["rows"]}


def test_a_checkpoint_alone_is_enough_and_its_export_gives_the_same_tau(trained, tmp_path, capsys):
    config, run = trained
    assert evaluate_main(["--checkpoint", str(run), *QUICK]) == 0, capsys.readouterr().err
    from_checkpoint = taus(capsys.readouterr().out)
    export = export_checkpoint(latest_checkpoint(run), tmp_path / "export", dtype="float32")
    assert evaluate_main(["--config", str(config), "--checkpoint", str(export), *QUICK]) == 0
    from_export = taus(capsys.readouterr().out)
    assert from_export["trained drafter"] == pytest.approx(from_checkpoint["trained drafter"])
    assert evaluate_main(["--checkpoint", str(export), *QUICK]) == 2
    assert "an export, which carries no training config: give --config" in capsys.readouterr().err


def test_a_drafter_of_another_target_is_refused_in_one_line(trained, make_target, tmp_path, capsys):
    config, run = trained
    raw = yaml.safe_load(config.read_text())
    raw["model"]["target_path"] = str(make_target("wider", hidden_size=48))
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(raw))
    assert evaluate_main(["--config", str(other), "--checkpoint", str(run), *QUICK]) == 2
    err = capsys.readouterr().err
    assert "trained for another target" in err and "target hidden_size 32 -> 48" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_without_held_out_rows_the_message_names_data_eval_path(trained, tmp_path, capsys):
    config, run = trained
    raw = yaml.safe_load(config.read_text())
    raw["data"]["eval_path"] = None
    bare = tmp_path / "bare.yaml"
    bare.write_text(yaml.safe_dump(raw))
    assert evaluate_main(["--config", str(bare), "--checkpoint", str(run), *QUICK]) == 2
    assert "data.eval_path is null" in capsys.readouterr().err
