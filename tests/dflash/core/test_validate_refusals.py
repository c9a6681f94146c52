"""`validate` (and `train --dry-run`) refuse what `train` refuses, with `train`'s own words: the data read as
the trainer reads it (an empty file, a line that is not JSON, a chat given as a training row, a token id
beyond the target's vocabulary, lists of unequal lengths; the token store's rows when one is packed), an
output directory the run cannot write in, a cuda layout on a machine without a GPU. Each case runs all
three commands on the same input: one message, exit 2, and the data's message is the loader's own."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from dflash_ops.config import main as validate_main
from dflash_ops.core.config import config_from_dict, target_shape
from dflash_ops.data.examples import DataError, load_examples, training_examples
from dflash_ops.data.pack import main as pack_main
from dflash_ops.run.main import main as train_main

GOOD_ROW = {"input_ids": [100, 101, 102, 103] + list(range(12)), "loss_mask": [0] * 4 + [1] * 12}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def refusals(path: str, capsys, *overrides: str) -> list[tuple[int, str]]:
    """(exit code, stderr) of validate, train --dry-run and train on the same config."""
    found = []
    for call in (lambda: validate_main(["validate", path, *overrides]),
                 lambda: train_main([path, *overrides, "--dry-run"]),
                 lambda: train_main([path, *overrides])):
        code = call()
        found.append((code, (capsys.readouterr().err.strip().splitlines() or [""])[-1]))
    return found


def config_file(tmp_path: Path, raw: dict) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def good(n: int) -> list[str]:
    return [json.dumps(GOOD_ROW)] * n


DATA_CASES = {
    "empty file": [],
    "blank lines only": ["", "  "],
    "line 41 not JSON": [*good(40), '{"input_ids": [1, 2', *good(5)],
    "sharegpt rows": [json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                                    {"from": "gpt", "value": "hello"}]})],
    "specforge rows": [json.dumps({"conversations": [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "hello"}]})],
    "out-of-vocabulary id": [*good(3), json.dumps({"input_ids": [1] * 15 + [999], "loss_mask": [1] * 16})],
    "unequal lists": [*good(2), json.dumps({"input_ids": [1] * 16, "loss_mask": [1] * 15})],
    "a mask that is not 0/1": [json.dumps({"input_ids": [1] * 16, "loss_mask": [2] * 16})],
    "a parquet file": None,
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_validate_refuses_the_data_train_refuses_with_the_loaders_words(case, tiny_config, tmp_path, capsys):
    data = tmp_path / "train.jsonl"
    if DATA_CASES[case] is None:
        data.write_bytes(b"PAR1\x15\x04\x15\xa0\x83\xff\x8f" + bytes(range(128, 256)) + b"PAR1")
    else:
        write_lines(data, DATA_CASES[case])
    raw = tiny_config(tmp_path / "run", data={"path": str(data)}, optim={"total_steps": 2})
    path = config_file(tmp_path, raw)
    with pytest.raises(DataError) as loader:  # what the run's own loader says of this file
        training_examples(config_from_dict(raw).data, target_shape(raw["model"]["target_path"])[1])
    found = refusals(path, capsys)
    assert found[0] == found[1] == found[2], found
    code, message = found[0]
    assert code == 2 and message == f"invalid config {path}: data.path: {loader.value.message}"
    if "line 41" in case:
        assert f"{data}:41: not JSON" in message
    if "rows" in case:
        assert "a chat (conversations)" in message and "dflash_ops.data regenerate" in message
    assert not (tmp_path / "run").exists(), "nothing started, nothing written"
    assert validate_main(["validate", "--json", path]) == 2
    answer = json.loads(capsys.readouterr().out)
    assert answer["key"] == "data.path" and answer["message"] == loader.value.message


@pytest.mark.parametrize("lines", [[], [*good(2), "not json"], [*good(1), json.dumps({"input_ids": [300],
                                                                                     "loss_mask": [1]})]])
def test_validate_refuses_the_held_out_data_the_run_refuses(lines, tiny_config, tmp_path, capsys):
    held_out = write_lines(tmp_path / "eval.jsonl", lines)
    raw = tiny_config(tmp_path / "run", data={"eval_path": str(held_out)}, optim={"total_steps": 2})
    with pytest.raises(DataError) as loader:  # the run's held-out loader (dflash_ops.training.drafter_run)
        load_examples(held_out, raw["data"]["max_length"], target_shape(raw["model"]["target_path"])[1])
    path = config_file(tmp_path, raw)
    found = refusals(path, capsys)
    expected = (2, f"invalid config {path}: data.eval_path: {loader.value.message}")
    assert found[0] == found[1] == found[2] == expected


def test_a_token_stores_out_of_vocabulary_row_is_refused_by_validate(tiny_config, tmp_path, capsys):
    data = write_lines(tmp_path / "train.jsonl",
                       [*good(4), json.dumps({"input_ids": [1] * 15 + [500], "loss_mask": [1] * 16})])
    assert pack_main([str(data)]) == 0
    raw = tiny_config(tmp_path / "run", data={"path": str(data)}, optim={"total_steps": 2})
    with pytest.raises(DataError, match=r"its token store, row 5\): token id 500") as loader:
        training_examples(config_from_dict(raw).data, target_shape(raw["model"]["target_path"])[1])
    path = config_file(tmp_path, raw)
    found = refusals(path, capsys)
    expected = (2, f"invalid config {path}: data.path: {loader.value.message}")
    assert found[0] == found[1] == found[2] == expected


def test_validate_counts_a_packed_store_as_the_json_lines(tiny_config, tmp_path, capsys):
    rows = [json.dumps({"input_ids": [7] * n, "loss_mask": [0] * (n - k) + [1] * k})
            for n, k in [(16, 12), (60, 40), (10, 1), (30, 2), (5, 5)]]
    data = write_lines(tmp_path / "train.jsonl", rows)
    raw = tiny_config(tmp_path / "run", data={"path": str(data)})
    path = config_file(tmp_path, raw)
    assert validate_main(["validate", "--json", path]) == 0
    plain = json.loads(capsys.readouterr().out)["data"]
    assert pack_main([str(data)]) == 0
    capsys.readouterr()
    assert validate_main(["validate", "--json", path]) == 0
    packed = json.loads(capsys.readouterr().out)["data"]
    assert packed == plain == {"rows": 5, "trainable_rows": 3, "cut_rows": 1}


def read_only_directory(tmp_path: Path):
    """A read-only mount (root), else a directory without write permission; None when neither works."""
    directory = tmp_path / "ro"
    directory.mkdir()
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return directory
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(directory)],
                          capture_output=True)
    return directory if done.returncode == 0 else None


@pytest.mark.parametrize("below", ["", "run"])
def test_an_output_dir_the_run_cannot_write_is_refused_by_validate(below, tiny_config, tmp_path, capsys):
    directory = read_only_directory(tmp_path)
    if directory is None:
        pytest.skip("no read-only mount here and root passes any permission")
    try:
        output = directory / below if below else directory
        path = config_file(tmp_path, tiny_config(output, optim={"total_steps": 2}))
        found = refusals(path, capsys)
        assert found[0] == found[1] == found[2], found
        code, message = found[0]
        assert code == 2 and message.startswith(f"invalid config {path}: run.output_dir: {directory} is ")
        assert "read-only mount" in message if os.geteuid() == 0 else "not writable" in message
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(directory)], check=True)
        else:
            directory.chmod(0o755)


def test_validate_of_a_live_runs_directory_leaves_it_as_it_was(tiny_config, tmp_path, capsys):
    output = tmp_path / "run"
    (output / "checkpoints").mkdir(parents=True)
    (output / "status.json").write_text("{}")
    before = sorted(p.name for p in output.rglob("*"))
    path = config_file(tmp_path, tiny_config(output, optim={"total_steps": 2}))
    assert validate_main(["validate", path]) == 0
    assert sorted(p.name for p in output.rglob("*")) == before, "no probe left, nothing written"


def test_a_cuda_layout_without_a_gpu_is_refused_by_validate(tiny_config, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU for this process, whatever the machine has
    path = config_file(tmp_path, tiny_config(tmp_path / "run", pipeline={"device": "cuda"},
                                             optim={"total_steps": 2}))
    found = refusals(path, capsys)
    assert found[0] == found[1] == found[2], found
    code, message = found[0]
    assert code == 2 and message.startswith(f"invalid config {path}: pipeline.device: 'cuda' requested but "
                                            "no CUDA device is visible")
    assert not (tmp_path / "run").exists()
