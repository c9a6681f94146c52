"""No silent empty or cut training: the rows that form a block and the rows data.max_length cuts are
counted before anything starts; none trainable is refused, as is a max_length past the target's positions
and a Hub id where a local directory is needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflash_ops.config import main as validate_main
from dflash_ops.core.config import ConfigError, check_against_target, config_from_dict, survey_data
from dflash_ops.run.main import main as train_main


def write_rows(path: Path, prompt_lengths: list[int], response: int = 8) -> Path:
    with path.open("w") as f:
        for n in prompt_lengths:
            f.write(json.dumps({"input_ids": [100] * n + list(range(response)),
                                "loss_mask": [0] * n + [1] * response}) + "\n")
    return path


def config_file(tmp_path: Path, raw: dict) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_a_config_under_which_no_row_forms_a_block_is_refused_before_anything_starts(tiny_config, tmp_path,
                                                                                     capsys):
    data = write_rows(tmp_path / "long_prompts.jsonl", [12, 13, 12])
    raw = tiny_config(tmp_path / "run", data={"path": str(data), "max_length": 14})
    path = config_file(tmp_path, raw)
    assert validate_main(["validate", "--json", path]) == 2
    answer = json.loads(capsys.readouterr().out)
    assert answer["key"] == "data.max_length" and "no row" in answer["message"]
    assert "3 rows, 3 cut" in answer["message"]
    assert train_main(["--config", path]) == 2
    assert "no row" in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "no worker started, nothing written"


def test_rows_that_cannot_train_and_cut_rows_are_counted_said_and_logged(tiny_config, tmp_path, capsys):
    data = write_rows(tmp_path / "mixed.jsonl", [4, 4, 12, 4])  # 12 + 8 = 20 tokens: cut at 14, no block
    raw = tiny_config(tmp_path / "run", data={"path": str(data), "max_length": 14, "batch_size": 2},
                      optim={"total_steps": 1})
    cfg = config_from_dict(raw)
    counts = survey_data(cfg)
    assert (counts.rows, counts.trainable, counts.cut) == (4, 3, 1)
    path = config_file(tmp_path, raw)
    assert validate_main(["validate", "--json", path]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["ok"] and answer["data"] == {"rows": 4, "trainable_rows": 3, "cut_rows": 1}
    assert "1 of 4 rows form no block" in answer["warning"] and "cuts 1 rows" in answer["warning"]
    assert validate_main(["validate", path]) == 0
    assert "warning:" in capsys.readouterr().err
    assert train_main(["--config", path]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    start = next(r for r in records if r["event"] == "start")
    assert (start["rows"], start["trainable_rows"], start["cut_rows"]) == (4, 3, 1)
    assert any(r["event"] == "warning" and "form no block" in r["message"] for r in records)


def test_max_length_over_the_targets_positions_is_refused(tiny_config, tmp_path, capsys):
    path = config_file(tmp_path, tiny_config(tmp_path / "run", data={"max_length": 512}))
    assert validate_main(["validate", "--json", path]) == 2
    answer = json.loads(capsys.readouterr().out)
    assert answer["key"] == "data.max_length" and "max_position_embeddings (256)" in answer["message"]


def test_a_hub_id_as_target_path_names_the_download_command(tiny_config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = tiny_config(tmp_path / "run", model={"target_path": "Qwen/Qwen3-0.6B"})
    with pytest.raises(ConfigError) as refused:
        check_against_target(config_from_dict(raw))
    assert refused.value.key == "model.target_path"
    assert "huggingface-cli download Qwen/Qwen3-0.6B --local-dir" in refused.value.message


def test_a_hub_id_given_to_regenerate_is_refused_before_anything_loads(tmp_path, capsys):
    from dflash_ops.data.__main__ import main as data_main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    code = data_main(["regenerate", "--target", "Qwen/Qwen3-0.6B", "--prompts", str(prompts), "--out",
                      str(tmp_path / "train.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and "huggingface-cli download Qwen/Qwen3-0.6B --local-dir" in err and "--target" in err


def test_eval_examples_over_the_held_out_rows_is_said(tiny_config, tiny_eval_dataset, tmp_path, capsys):
    raw = tiny_config(tmp_path / "run", data={"eval_path": str(tiny_eval_dataset), "eval_examples": 500})
    assert validate_main(["validate", "--json", config_file(tmp_path, raw)]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert "data.eval_examples is 500, data.eval_path holds 4 rows: 4 are evaluated" in answer["warning"]
