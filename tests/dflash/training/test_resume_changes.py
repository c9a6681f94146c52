"""A resume says what changed since its checkpoint: a schedule key is warned about and logged, a key of the
drafter's shape or a target of another shape is refused before anything loads, and a refused start leaves
the old run's status.json as it was."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflash_ops.run.main import main as train_main
from dflash_ops.training.checkpoint import latest_checkpoint


def write_config(path: Path, raw: dict) -> str:
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def first_run(tiny_config, tmp_path, capsys) -> tuple[Path, str]:
    run = tmp_path / "run"
    config = write_config(tmp_path / "first.yaml", tiny_config(run, optim={"total_steps": 2}))
    assert train_main(["--config", config]) == 0
    capsys.readouterr()
    return run, (run / "status.json").read_text()


def test_a_changed_schedule_key_is_warned_about_and_logged(tiny_config, tmp_path, capsys):
    run, _ = first_run(tiny_config, tmp_path, capsys)
    config = write_config(tmp_path / "again.yaml", tiny_config(run, optim={"total_steps": 3, "lr": 1e-3}))
    assert train_main(["--config", config]) == 0
    out, err = capsys.readouterr()
    assert "warning" in err and "optim.lr 0.003 -> 0.001" in err and "optim.total_steps 2 -> 3" in err
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    resume = next(r for r in records if r["event"] == "resume")
    assert resume["changed"] == {"optim.lr": [0.003, 0.001], "optim.total_steps": [2, 3]}
    assert any(r["event"] == "warning" and "optim.lr" in r["message"] for r in records)


def test_a_shape_change_is_refused_before_anything_loads_and_the_status_stays(tiny_config, tmp_path, capsys):
    run, status = first_run(tiny_config, tmp_path, capsys)
    config = write_config(tmp_path / "deeper.yaml", tiny_config(run, model={"num_draft_layers": 2}))
    assert train_main(["--config", config]) == 2
    err = capsys.readouterr().err
    assert "model.num_draft_layers 1 -> 2" in err and "Traceback" not in err
    assert (run / "status.json").read_text() == status


def test_a_target_of_another_shape_is_refused_in_one_line(tiny_config, make_target, tmp_path, capsys):
    run, status = first_run(tiny_config, tmp_path, capsys)
    wider = make_target("wider", hidden_size=48)
    config = write_config(tmp_path / "wider.yaml", tiny_config(run, model={"target_path": str(wider)}))
    assert train_main(["--config", config]) == 2
    err = capsys.readouterr().err
    assert "target hidden_size 32 -> 48" in err and "size mismatch" not in err and "Traceback" not in err
    assert (run / "status.json").read_text() == status


def test_another_mask_token_than_the_checkpoints_is_refused_before_anything_loads(tiny_config, tmp_path,
                                                                                   capsys):
    run, status = first_run(tiny_config, tmp_path, capsys)
    meta = json.loads((latest_checkpoint(run) / "meta.json").read_text())
    trained = meta["drafter_config"]["mask_token_id"]
    other = 5 if trained != 5 else 6
    config = write_config(tmp_path / "mask.yaml", tiny_config(run, model={"mask_token_id": other}))
    assert train_main(["--config", config]) == 2
    assert f"model.mask_token_id {trained} -> {other}" in capsys.readouterr().err
    assert (run / "status.json").read_text() == status



def test_a_start_that_crashes_while_loading_keeps_the_old_runs_step_and_checkpoint(tiny_config, tmp_path,
                                                                                 capsys, monkeypatch):
    run, status = first_run(tiny_config, tmp_path, capsys)
    old = json.loads(status)

    def unreadable(*args, **kwargs):
        shown = json.loads((run / "status.json").read_text())  # while it loads: the checkpoint it resumes
        assert (shown["state"], shown["step"]) == ("starting", 2)
        assert shown["last_checkpoint"] == old["last_checkpoint"]
        raise RuntimeError("the target's weights are unreadable")

    monkeypatch.setattr("dflash_ops.run.main.load_target", unreadable)
    config = write_config(tmp_path / "again.yaml", tiny_config(run, optim={"total_steps": 4}))
    assert train_main(["--config", config]) == 1
    assert "the target's weights are unreadable" in capsys.readouterr().err
    shown = json.loads((run / "status.json").read_text())
    assert (shown["state"], shown["error"]) == ("failed", "RuntimeError: the target's weights are unreadable")
    assert {k: shown[k] for k in ("step", "last_checkpoint", "heldout_loss", "heldout_tau")} == \
        {k: old[k] for k in ("step", "last_checkpoint", "heldout_loss", "heldout_tau")}


def step_lrs(text: str) -> dict[int, float]:
    records = (json.loads(line) for line in text.splitlines() if line.startswith("{"))
    return {r["step"]: r["lr"] for r in records if r["event"] == "step"}


def test_a_resume_trains_at_the_configs_lr_and_schedule_with_the_moments_kept(tiny_config, tmp_path, capsys):
    """optim.lr and the schedule's keys come from the config a run resumes with: the rate of the first
    resumed step is the new lr on the new schedule at that step; the AdamW moments are the checkpoint's."""
    import torch

    from dflash_ops.training.trainer import lr_multiplier

    run, _ = first_run(tiny_config, tmp_path, capsys)
    saved = torch.load(latest_checkpoint(run) / "trainer.pt", weights_only=False)
    moments = saved["trainer"]["optimizer"]["state"]
    config = write_config(tmp_path / "faster.yaml",
                          tiny_config(run, optim={"total_steps": 10, "lr": 3e-2, "warmup_ratio": 0.2}))
    assert train_main(["--config", config, "run.max_steps_per_run=1"]) == 0
    out, err = capsys.readouterr()
    assert "optim.lr 0.003 -> 0.03" in err and "applied" in err
    # Step 3 is the first resumed step: it ran with the scheduler at step 2 of the new 10-step schedule.
    assert step_lrs(out)[3] == pytest.approx(3e-2 * lr_multiplier(2, 2, 10), rel=1e-9)
    resumed = torch.load(latest_checkpoint(run) / "trainer.pt", weights_only=False)["trainer"]["optimizer"]
    assert [g["initial_lr"] for g in resumed["param_groups"]] == [3e-2] * len(resumed["param_groups"])
    # The moments went on from the checkpoint's (one more step), not from zero.
    for key, state in resumed["state"].items():
        assert int(state["step"]) == int(moments[key]["step"]) + 1


def test_a_changed_seed_is_refused_before_anything_is_written(tiny_config, tmp_path, capsys):
    run, status = first_run(tiny_config, tmp_path, capsys)
    config = write_config(tmp_path / "seed.yaml", tiny_config(run, run={"seed": 1}))
    assert train_main(["--config", config]) == 2
    err = capsys.readouterr().err
    assert "run.seed 0 -> 1" in err and "Traceback" not in err
    assert (run / "status.json").read_text() == status
