"""Which drafter a command used: `evaluate` says the checkpoint's step, the data file and the prompts it
measured; an export records its run and step, and `export --into` refuses a directory that holds another
run's export of the same step instead of keeping it (its checksums match) or writing over it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_ops.core.config import config_from_dict
from dflash_ops.run.main import run_single_process
from dflash_ops.serve.evaluate import main as evaluate_main
from dflash_ops.serve.export import main as export_main

QUICK = ["--num-prompts", "2", "--max-new-tokens", "4", "--no-target-row"]


@pytest.fixture
def two_runs(tiny_config, tiny_eval_dataset, tmp_path, capsys) -> tuple[Path, Path]:
    runs = []
    for name, seed in (("a", 0), ("b", 1)):
        raw = tiny_config(tmp_path / name, optim={"total_steps": 2}, run={"seed": seed, "save_every": 1},
                          data={"eval_path": str(tiny_eval_dataset)})
        assert run_single_process(config_from_dict(raw)) == 0
        runs.append(tmp_path / name)
    capsys.readouterr()
    return runs[0], runs[1]


def test_evaluate_says_which_step_data_and_count_it_measured(two_runs, tiny_eval_dataset, capsys):
    run, _ = two_runs
    assert evaluate_main(["--checkpoint", str(run), *QUICK, "--json"]) == 0, capsys.readouterr().err
    result = json.loads(capsys.readouterr().out)
    assert {k: result[k] for k in ("checkpoint", "step", "data", "prompts")} == {
        "checkpoint": str(run / "checkpoints" / "step-00000002"), "step": 2, "data": str(tiny_eval_dataset),
        "prompts": 2}
    assert evaluate_main(["--checkpoint", str(run / "checkpoints" / "step-00000001"), *QUICK]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    step_1 = run / "checkpoints" / "step-00000001"
    data = tiny_eval_dataset
    assert first == f"checkpoint {step_1} (step 1); data {data}: 2 prompts, up to 4 new tokens each"


def test_export_into_a_directory_of_another_runs_export_is_refused(two_runs, tmp_path, capsys):
    run_a, run_b = two_runs
    exports = tmp_path / "exports"
    assert export_main(["--checkpoint", str(run_a), "--into", str(exports)]) == 0
    first = json.loads(capsys.readouterr().out)
    config = json.loads((exports / "step-00000002" / "config.json").read_text())
    assert config["dflash_source"] == {"run": str(run_a.resolve()), "step": 2}
    before = (exports / "step-00000002" / "model.safetensors").read_bytes()

    assert export_main(["--checkpoint", str(run_b), "--into", str(exports)]) == 2
    err = capsys.readouterr().err
    assert f"holds the export of another run ({run_a.resolve()}, step 2)" in err
    assert "nothing was written" in err
    assert (exports / "step-00000002" / "model.safetensors").read_bytes() == before
    # Its own run's export is still kept as it is, and another directory takes run b's.
    assert export_main(["--checkpoint", str(run_a), "--into", str(exports)]) == 0
    assert json.loads(capsys.readouterr().out)["reused"] is True and first["reused"] is False
    assert export_main(["--checkpoint", str(run_b), "--into", str(tmp_path / "exports-b")]) == 0
