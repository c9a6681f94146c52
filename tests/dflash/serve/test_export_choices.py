"""The export names its target (README and config.json), says its layer count in good English, can take
the checkpoint of the best held-out tau; a run without held-out rows gets a tau plot that says why it is
empty."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import yaml

from dflash_ops.run.main import main as train_main
from dflash_ops.serve.export import main as export_main
from dflash_ops.training.checkpoint import list_checkpoints, step_of
from dflash_ops.training.plots import main as plots_main


def train(tiny_config, tmp_path: Path, capsys, **sections) -> Path:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(tmp_path / "run", **sections)))
    assert train_main([str(config)]) == 0
    capsys.readouterr()
    return tmp_path / "run"


def test_best_picks_the_kept_checkpoint_of_the_best_heldout_tau_and_the_export_names_its_target(
        tiny_config, tiny_target, tiny_eval_dataset, tmp_path, capsys):
    run = train(tiny_config, tmp_path, capsys, optim={"total_steps": 4},
                data={"eval_path": str(tiny_eval_dataset), "eval_examples": 2},
                run={"save_every": 1, "eval_every": 1, "keep_checkpoints": 3})
    kept = {step_of(p) for p in list_checkpoints(run)}
    taus = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "heldout" and record["step"] in kept:
            taus[record["step"]] = record["heldout_tau"]
    best = max(taus, key=lambda step: (taus[step], step))
    assert export_main(["--checkpoint", str(run), "--best", "--out", str(tmp_path / "export")]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == best

    config = json.loads((tmp_path / "export" / "config.json").read_text())
    target_config = (tiny_target / "config.json").read_bytes()
    assert config["dflash_target"]["config_sha256"] == hashlib.sha256(target_config).hexdigest()
    assert config["dflash_target"]["name_or_path"]
    readme = (tmp_path / "export" / "README.md").read_text()
    assert "(1 draft layer, block size 4" in readme and "1 draft layers" not in readme
    assert config["dflash_target"]["name_or_path"] in readme


def test_without_heldout_rows_best_is_refused_and_the_tau_plot_says_why_it_is_empty(tiny_config, tmp_path,
                                                                                     capsys):
    run = train(tiny_config, tmp_path, capsys, optim={"total_steps": 2})
    assert export_main(["--checkpoint", str(run), "--best", "--out", str(tmp_path / "export")]) == 2
    assert "has a held-out tau" in capsys.readouterr().err
    assert plots_main([str(run), "--out", str(tmp_path / "plots")]) == 0
    note = "note: tau.png is empty: no held-out figures: the run had no data.eval_path"
    assert note in capsys.readouterr().err
