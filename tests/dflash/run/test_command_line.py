"""The trainer's command line as ML users expect it: the config first (`--config` still works), then
SECTION.KEY=VALUE overrides typed like the file's; `--dry-run`; YAML floats such as 3e-3; a `--help`
with the sections; a config reference generated from the config classes that the docs match."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from dflash_ops.capture import main as capture_main
from dflash_ops.config import main as config_main
from dflash_ops.core.config import SECTIONS, load_config
from dflash_ops.run.main import main as train_main
from dflash_ops.training.checkpoint import latest_checkpoint

REPO = Path(__file__).resolve().parents[3]


def config_file(tmp_path: Path, raw: dict) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_overrides_after_the_config_are_typed_applied_and_echoed(tiny_config, tmp_path, capsys):
    path = config_file(tmp_path, tiny_config(tmp_path / "run", optim={"total_steps": 20}))
    assert train_main([path, "optim.total_steps=2", "optim.lr=1e-3", "run.save_every=1"]) == 0
    start = next(r for r in records(capsys.readouterr().out) if r["event"] == "start")
    assert start["total_steps"] == 2
    assert start["overrides"] == ["optim.total_steps=2", "optim.lr=1e-3", "run.save_every=1"]
    saved = yaml.safe_load((latest_checkpoint(tmp_path / "run") / "config.yaml").read_text())
    assert saved["optim"]["lr"] == 0.001 and saved["optim"]["total_steps"] == 2
    # The older spelling, with overrides after it.
    assert load_config(path, overrides=["optim.lr=2e-3"]).optim.lr == 0.002
    assert train_main(["--config", path, "optim.total_steps=3", "--dry-run"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["optim"]["total_steps"] == 3


@pytest.mark.parametrize(("item", "expected"), [
    ("optim.lr=fast", "optim.lr: expected float, got 'fast'"),
    ("optim.nope=1", "optim: unknown key(s) nope"),
    ("lr=1e-3", "expected SECTION.KEY=VALUE"),
])
def test_a_bad_override_is_refused_like_a_bad_file(tiny_config, tmp_path, capsys, item, expected):
    path = config_file(tmp_path, tiny_config(tmp_path / "run"))
    assert train_main([path, item]) == 2
    assert expected in capsys.readouterr().err
    assert config_main(["validate", "--json", path, item]) == 2
    answer = json.loads(capsys.readouterr().out)
    assert expected in f"{answer['key']}: {answer['message']}"
    assert capture_main([path, item]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_validate_takes_overrides_and_both_spellings(tiny_config, tmp_path, capsys):
    path = config_file(tmp_path, tiny_config(tmp_path / "run"))
    assert config_main(["validate", "--json", path, "data.batch_size=2"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["ok"] and answer["overrides"] == ["data.batch_size=2"]
    assert config_main(["validate", "--config", path, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]
    assert config_main(["validate", "--json", path, "data.batch_size=four"]) == 2
    assert json.loads(capsys.readouterr().out)["key"] == "data.batch_size"


def test_yaml_floats_in_exponent_form_are_floats(tiny_config, tmp_path):
    raw = tiny_config(tmp_path / "run")
    text = yaml.safe_dump(raw).replace("lr: 0.003", "lr: 3e-3")
    assert "lr: 3e-3" in text
    (tmp_path / "config.yaml").write_text(text)
    assert load_config(tmp_path / "config.yaml").optim.lr == 0.003


def test_dry_run_prints_the_effective_config_and_starts_nothing(tiny_config, tmp_path, capsys):
    path = config_file(tmp_path, tiny_config(tmp_path / "run", optim={"total_steps": 50}))
    assert train_main([path, "--dry-run", "optim.warmup_ratio=0.1"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    resolved = printed["resolved"]
    assert printed["optim"]["warmup_ratio"] == 0.1 and resolved["warmup_steps"] == 5
    assert resolved["total_steps"] == 50 and resolved["target_layer_ids"] == [2]
    assert resolved["gamma"] == 1.0 and isinstance(resolved["mask_token_id"], int)
    assert resolved["data"] == {"rows": 32, "trainable_rows": 32, "cut_rows": 0}
    assert resolved["resume_from"] is None and resolved["overrides"] == ["optim.warmup_ratio=0.1"]
    assert not (tmp_path / "run").exists(), "nothing written"


def test_help_lists_the_sections_and_the_reference_lists_every_key(capsys):
    with pytest.raises(SystemExit):
        train_main(["--help"])
    shown = capsys.readouterr().out
    assert "python -m dflash_ops.config reference" in shown and "--dry-run" in shown
    assert all(re.search(rf"^  {name}\s", shown, re.M) for name in SECTIONS)
    assert config_main(["reference"]) == 0
    reference = capsys.readouterr().out
    contracts = (REPO / "docs" / "CONTRACTS.md").read_text()
    for name, cls in SECTIONS.items():
        assert f"\n{name}:\n" in reference and f"\n{name}:\n" in contracts
        for f in dataclasses.fields(cls):
            assert re.search(rf"^  {f.name}: ", reference, re.M), f"{name}.{f.name} not in the reference"
            assert re.search(rf"^  {f.name}:", contracts, re.M), f"{name}.{f.name} not in docs/CONTRACTS.md"


def test_a_pipelines_workers_get_the_command_lines_overrides(monkeypatch):
    from dflash_ops.core.config import PipelineConfig
    from dflash_ops.run import pipeline
    from dflash_ops.run.launcher import torchrun_command

    command = torchrun_command(PipelineConfig(target_workers=1, drafter_workers=1), "/srv/config.yaml", 2,
                               "/tmp/errors", ("optim.lr=1e-3", "run.seed=2"))
    worker_args = command[command.index("dflash_ops.run.pipeline") + 1:]
    assert worker_args == ["--config", "/srv/config.yaml", "optim.lr=1e-3", "run.seed=2"]
    seen = {}
    monkeypatch.setattr(pipeline, "worker_main", lambda path, overrides: seen.update(path=path, o=overrides))
    pipeline.main(worker_args)
    assert seen == {"path": "/srv/config.yaml", "o": ["optim.lr=1e-3", "run.seed=2"]}
