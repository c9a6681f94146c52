"""A feature cache of a subset of the data (`python -m dflash_ops.capture --rows A:B | --fraction F`): the
rows are written beside the cache as its data set, the plan says which rows of which file it holds, a run that
names that file trains from it, and one that names the whole file is told which data.path to set."""

from __future__ import annotations

import json

import pytest

from dflash_ops.capture import main as capture_main
from dflash_ops.core.config import ConfigError, config_from_dict
from dflash_ops.data.feature_cache import MANIFEST, check_cache
from dflash_ops.data.subset import SUBSET_FILE, chosen_rows, parse_rows
from dflash_ops.run.main import run_single_process


def test_rows_and_fractions_choose_the_rows_they_say():
    assert parse_rows("4:20") == (4, 20) and parse_rows("4:") == (4, None) and parse_rows(":3") == (None, 3)
    assert chosen_rows(32, (4, 20), None) == range(4, 20) and chosen_rows(32, (None, 3), None) == range(0, 3)
    # Evenly spread: a file in prompt order is sampled across it, not cut at one end.
    assert chosen_rows(10, None, 0.3) == [0, 3, 6]
    assert chosen_rows(32, None, 0.25) == [0, 4, 8, 12, 16, 20, 24, 28]
    assert chosen_rows(5, None, 1.0) == [0, 1, 2, 3, 4]
    bad = (((20, 4), None, "--rows"), ((0, 33), None, "--rows"), (None, 0.0, "--fraction"),
           (None, 1.5, "--fraction"), (None, 0.01, "--fraction"))
    for rows, fraction, key in bad:
        with pytest.raises(ConfigError) as refused:
            chosen_rows(32, rows, fraction)
        assert refused.value.key == key
    for text in ("4", "a:b", "-1:3"):
        with pytest.raises(ConfigError, match="--rows"):
            parse_rows(text)


def test_a_cache_of_some_rows_trains_a_run_that_names_them(tiny_config, tiny_dataset, tmp_path, capsys):
    out = tmp_path / "cache"
    raw = tiny_config(tmp_path / "run", optim={"total_steps": 3}, run={"save_every": 3})
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(raw))
    assert capture_main([str(config), "--out", str(out), "--rows", "4:20"]) == 0
    lines = [line for line in tiny_dataset.read_text().splitlines() if line.strip()]
    assert (out / SUBSET_FILE).read_text().splitlines() == lines[4:20]
    manifest = json.loads((out / MANIFEST).read_text())
    subset = manifest["dataset"]["subset"]
    assert (subset["rows"], subset["kept"], subset["of_rows"]) == ([4, 20], 16, len(lines))
    assert subset["of"] == str(tiny_dataset) and manifest["dataset"]["examples"] == 16
    captured = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert captured[-1]["event"] == "captured" and captured[-1]["data_path"] == str(out / SUBSET_FILE)

    # The whole file as data.path: refused with the file to name.
    whole = config_from_dict({**raw, "data": {**raw["data"], "features_path": str(out)}})
    with pytest.raises(ConfigError, match="rows 4:20 of .* set data.path to that file") as refused:
        check_cache(whole)
    assert refused.value.key == "data.path" and str(out / SUBSET_FILE) in refused.value.message
    # The subset's file as data.path: it trains from the cache, on the 16 rows.
    cfg = config_from_dict({**raw, "data": {**raw["data"], "path": str(out / SUBSET_FILE),
                                            "features_path": str(out)}})
    assert check_cache(cfg) == manifest
    capsys.readouterr()
    assert run_single_process(cfg) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert events[0]["event"] == "start" and events[0]["examples"] == 16
    assert events[-1] == {**events[-1], "event": "stop", "step": 3, "reason": "completed"}

    # A capture into the same directory of other rows is refused; of the same rows it resumes (nothing to do).
    assert capture_main([str(config), "--out", str(out), "--rows", "0:16"]) == 2
    assert "holds other rows" in capsys.readouterr().err
    assert (out / SUBSET_FILE).read_text().splitlines() == lines[4:20]
    assert capture_main([str(config), "--out", str(out), "--rows", "4:20"]) == 0
    assert json.loads((out / MANIFEST).read_text()) == manifest


def test_a_fraction_is_spread_over_the_file(tiny_config, tiny_dataset, tmp_path):
    out = tmp_path / "cache"
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(tiny_config(tmp_path / "run")))
    assert capture_main([str(config), "--out", str(out), "--fraction", "0.25"]) == 0
    lines = [line for line in tiny_dataset.read_text().splitlines() if line.strip()]
    assert (out / SUBSET_FILE).read_text().splitlines() == lines[::4]
    subset = json.loads((out / MANIFEST).read_text())["dataset"]["subset"]
    assert (subset["fraction"], subset["kept"]) == (0.25, len(lines) // 4)
