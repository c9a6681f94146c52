"""What a run will cost before it starts (dflash_ops.run.balance.RunCost): `validate` says the recipe's
samples/s and GPU-hours, modelled from the one measured drafter step (BENCHMARKS.md section 10) and the
shapes, or measured, from a run's balance line."""

from __future__ import annotations

import dataclasses
import json

import pytest

import dflash_ops.config as config_command
from dflash_ops.core.config import load_config, with_examples
from dflash_ops.core.loss_section import LossConfig
from dflash_ops.run import balance
from dflash_ops.run.balance import H200_DRAFTER_STEP, MeasuredWaits, modelled_cost
from dflash_ops.training import memory_fit
from dflash_ops.training.memory_fit import QWEN3_8B

ROWS = 800_000  # a regenerated data set of the paper's size


def recipe(rows: int = ROWS, **pipeline):
    cfg = with_examples(load_config("configs/qwen3-8b.yaml", check_target=False), rows)
    if pipeline:
        cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, **pipeline))
    return cfg


def test_the_recipe_costs_its_samples_over_the_drafters_measured_pace():
    cost = modelled_cost(recipe(), QWEN3_8B)
    # The measured step is the recipe's own drafter step: 1.456 s for 8 samples on one H200.
    assert cost.drafter_s == pytest.approx(H200_DRAFTER_STEP.seconds / H200_DRAFTER_STEP.samples)
    # The target's ~43 TFLOP a sample at the same pace: 3 targets keep 5 drafters fed, just.
    target_flops, drafter_flops = balance.predicted_costs(recipe(), QWEN3_8B)
    assert cost.target_s == pytest.approx(cost.drafter_s * target_flops / drafter_flops)
    assert cost.slower == "drafter" and cost.samples_per_s == pytest.approx(5 / 0.182)
    # 6 epochs of 800,000 rows over 8 x 5 a step: 4.8 M samples, 48.5 h on 8 GPUs.
    assert cost.samples == 6 * ROWS and cost.gpus == 8
    assert cost.hours == pytest.approx(6 * ROWS / (5 / 0.182) / 3600)
    assert cost.gpu_hours == pytest.approx(8 * cost.hours) and round(cost.gpu_hours) == 388
    # The seeds' 5 targets : 3 drafters: the drafters bind harder, the same GPUs for longer.
    seeds = modelled_cost(recipe(target_gpus=[0, 1, 2, 3, 4], drafter_gpus=[5, 6, 7]), QWEN3_8B)
    assert seeds.samples_per_s == pytest.approx(3 / 0.182) and seeds.gpu_hours > 1.6 * cost.gpu_hours


@pytest.mark.parametrize("kind", ["dflash", "dflash_distilled", "dspark"])
def test_a_gpu_check_s_part_g_corrects_the_modelled_step_of_a_distilled_or_dspark_drafter(tmp_path, kind):
    """Part f's DFlash step at the recipe's shape, scaled by the FLOPs model to the drafter's kind; with part
    g, by its measured ratio over DFlash instead of the model's."""
    cfg = with_examples(load_config("configs/qwen3-8b-dspark.yaml" if kind == "dspark" else
                                    "configs/qwen3-8b.yaml", check_target=False), ROWS)
    if kind == "dflash_distilled":
        cfg = dataclasses.replace(cfg, loss=LossConfig("mix", {"ce": 0.1, "tvd": 0.9}))
    assert balance.check_kind(cfg) == kind
    part_f = {"device": "NVIDIA H200", "dry_run": False, "drafter_speed": {"auto": {"step_s": 1.1}}}
    ratios = {"dflash": (1.0, 1.0), "dflash_distilled": (1.25, 1.13), "dspark": (1.8, 1.46)}
    part_g = {k: {"step_s": 1.5 * t, "time_ratio": t, "modelled_ratio": m} for k, (t, m) in ratios.items()}
    with_g = {**part_f, "drafter_kinds": {**part_g, "shape": "the recipe"}}
    costs = {}
    for name, record in (("f", part_f), ("fg", with_g)):
        (tmp_path / f"{name}.json").write_text(json.dumps(record))
        costs[name] = balance.measured_cost(cfg, tmp_path / f"{name}.json", QWEN3_8B)
    if kind == "dflash":  # part f times DFlash itself: nothing to correct
        assert dataclasses.replace(costs["fg"], how="") == dataclasses.replace(costs["f"], how="")
        assert "part g" not in costs["fg"].how
        return
    time_ratio, modelled_ratio = ratios[kind]
    assert costs["fg"].drafter_s == pytest.approx(costs["f"].drafter_s * time_ratio / modelled_ratio)
    assert costs["fg"].target_s == costs["f"].target_s
    assert f"{kind}'s step over DFlash's as part g measured it, {time_ratio}x against the model's " \
           f"{modelled_ratio}x" in costs["fg"].how


def test_a_cpu_layout_has_no_modelled_cost_the_figure_is_a_gpu_s():
    assert modelled_cost(recipe(device="cpu", target_gpus=[], drafter_gpus=[], target_workers=3,
                                drafter_workers=5), QWEN3_8B) is None


@pytest.fixture
def recipe_validate(monkeypatch):
    """`python -m dflash_ops.config validate` on the recipe as on its machine (a Qwen3-8B target, 800,000
    rows), without the machine: its config loaded counted, the target's shape Qwen3-8B's."""
    monkeypatch.setattr(config_command, "load_config", lambda *a, **k: recipe())
    monkeypatch.setattr(config_command, "check_thinking_mode", lambda cfg: None)
    monkeypatch.setattr(config_command, "check_features", lambda cfg: None)
    monkeypatch.setattr(config_command, "check_cuda_build", lambda cfg, machine: None)
    monkeypatch.setattr(memory_fit.TargetShape, "read", classmethod(lambda cls, path: QWEN3_8B))
    return lambda *args: config_command.main(["validate", "configs/qwen3-8b.yaml", "--gpu-memory", "141GiB",
                                              *args])


def test_validate_prints_the_recipe_s_modelled_samples_per_second_and_gpu_hours(recipe_validate, capsys):
    assert recipe_validate() == 0
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith("cost (")]
    assert line.startswith("cost (modelled from the H200 drafter step of BENCHMARKS.md section 10): "
                           "27.47 samples/s")
    assert "4,800,000 samples (6 epochs of 800,000 rows): 48.5 h on 8 GPUs, 388 GPU-hours" in line
    assert recipe_validate("--json") == 0
    cost = json.loads(capsys.readouterr().out)["cost"]
    assert cost["how"].startswith("modelled") and cost["gpu_hours"] == pytest.approx(388.3, abs=0.1)
    assert cost["slower_side"] == "drafter" and cost["samples"] == 6 * ROWS


def test_validate_says_the_cost_measured_by_a_run_s_balance_line(recipe_validate, capsys, tmp_path):
    waits = MeasuredWaits(targets=3, drafters=5)
    waits.follow({"event": "waits", "worker": "target0", "batches": 10, "compute_s": 12.0, "wall_s": 13.0})
    waits.follow({"event": "step", "interval_steps": 10, "busy_s": 20.0, "wait_fraction": 0.1})
    fields = waits.advice()
    assert (fields["target_cost_s"], fields["drafter_cost_s"]) == (1.2, 2.0)  # seconds a batch of 8
    status = tmp_path / "status.json"
    status.write_text(json.dumps({"state": "running", "balance": fields}))
    assert recipe_validate("--measured", str(status)) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cost (")]
    # 5 drafters at 2.0 s a batch of 8: 20 samples/s against 3 targets' 20 (1.2 s a batch): both sides.
    assert line.startswith(f"cost (measured: the run's balance in {status}): 20.00 samples/s")
    assert f"{6 * ROWS / 20 / 3600:.1f} h on 8 GPUs" in line
    log = tmp_path / "main.log"  # the run's log: its last balance line
    log.write_text("\n".join(json.dumps(r) for r in ({"event": "balance", **fields, "drafter_cost_s": 4.0},
                                                      {"event": "step", "step": 9},
                                                      {"event": "balance", **fields})) + "\n")
    assert recipe_validate("--measured", str(log), "--json") == 0
    assert json.loads(capsys.readouterr().out)["cost"]["samples_per_s"] == 20.0
    check = tmp_path / "gpu_check.json"  # a GPU check's part f: its flex step replaces the H200 figure
    check.write_text(json.dumps({"device": "NVIDIA H100", "dry_run": False,
                                 "drafter_speed": {"auto": {"step_s": 1.1, "samples_per_s": 7.27}}}))
    assert recipe_validate("--measured", str(check), "--json") == 0
    cost = json.loads(capsys.readouterr().out)["cost"]
    assert cost["how"] == f"drafter step measured in {check}, the rest modelled from it"
    assert cost["drafter_s_per_sample"] == round(1.1 / 8, 4)
    assert cost["samples_per_s"] == round(5 / (1.1 / 8), 3)
    empty = tmp_path / "nothing.json"
    empty.write_text("{}")
    assert recipe_validate("--measured", str(empty)) == 2
    assert "holds no measured step time" in capsys.readouterr().err
