"""The GPU check runs end to end on CPU at a tiny width (`--dry-run`) before a GPU sees it, checks its
toolchain first and fits one call (its parts by value within `--budget`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check_plan as plan

REPO = Path(__file__).resolve().parents[2]


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.slow
def test_the_dry_run_runs_every_part_in_the_order_of_value_and_writes_its_table_and_json(tmp_path):
    """~35 s of CPU: every part at a tiny width, the training part's three runs in processes of their own."""
    done = gpu_check("--dry-run", "--parts", *reversed(plan.ORDER), "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record == json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["ok"] and record["dry_run"] and record["budget_s"] is None
    parts = [key for key in record if key in plan.ORDER]
    assert parts == list(plan.ORDER)  # most valuable first, the tiles last, whatever the order asked
    assert not [part for part in parts if "error" in record[part] or "left_out" in record[part]]
    assert record["toolchain"]["compiler"] and not record["toolchain"]["problems"]  # Triton: a note on CPU

    drafter = record["drafter_step"]
    assert drafter["unchunked"]["loss"] == pytest.approx(drafter["chunked"]["loss"], rel=1e-3)
    assert drafter["chunked"]["samples_per_s"] > 0 and drafter["chunked"]["peak_gib"] > 0
    capture = record["target_capture"]
    assert capture["whole_batch"]["tokens_per_s"] > 0 and capture["rows_per_pass_1"]["tokens_per_s"] > 0
    if "summary" in record["gpu_tests"]:  # pytest found: the CUDA tests were selected and skipped
        assert "skipped" in record["gpu_tests"]["summary"]
        assert "tests/dflash/model/test_flex_attention.py" in record["gpu_tests"]["paths"]
    training = record["training"]
    assert training["device"] == "cpu" and training["stop"] == "signal SIGTERM"
    assert 3 <= training["stopped_at"] < training["steps"] and training["losses_equal"]

    recipe = record["recipe"]
    step, heldout = recipe["drafter_step"], recipe["heldout"]
    assert step["blocks"] == 2 * 8 and step["loss"] > 0  # batch 2, 8 anchors a sequence: the dry shape
    assert heldout["documents"] == 3 and heldout["tau"] >= 1
    for phase in (step, heldout):
        assert phase["peak_bytes"] > 0 and phase["seconds"] > 0
        assert phase["predicted_bytes"] > 0  # the memory model answered for the phase
    # The step on one GPU: no DDP buckets, no feature queue beyond its batch, no held-out features.
    assert "ddp_buckets" not in step["predicted_terms_gib"]
    assert "heldout_features" not in step["predicted_terms_gib"]
    assert "heldout_features" in heldout["predicted_terms_gib"]

    auto, tiles = record["drafter_speed"]["auto"], record["tiles_speed"]["tiles"]
    assert "tiles" not in record["drafter_speed"] and "auto" not in record["tiles_speed"]
    # torch has no FlexAttention backward on CPU: there auto is the tiles, and says why.
    assert auto["backend"] == tiles["backend"] == "tiles" and "backward" in auto["reason"]
    for row in (auto, tiles):
        assert row["samples_per_s"] > 0 and row["tokens_per_s"] > 0 and row["blocks"] == 2 * 8
        assert row["new_graphs_after_warmup"] == 0
    assert len(auto["steps_s"]) == 4 and len(tiles["steps_s"]) == 1  # the tiles: one measured step
    assert auto["loss"] == pytest.approx(tiles["loss"], rel=1e-2)  # same weights, data and anchors
    assert record["drafter_speed"]["reference"]["samples_per_s"] == 8.7
    assert record["drafter_kinds"]["dspark"]["drafter"] == "DSparkDrafter"

    table = (tmp_path / "gpu_check.txt").read_text()
    for heading in ("toolchain: Triton", "a. drafter step", "b. target capture", "c. pytest -m gpu",
                    "d. training", "e. the recipe's drafter rank (configs/qwen3-8b.yaml: 2 layers",
                    "f. the drafter step by attention backend (2 layers, H 64, batch 2 x 64",
                    "speed-up over the tiles", "g. the drafter step by kind", "seconds by part", "nccl"):
        assert heading in table
    assert table in done.stdout


def test_the_parts_run_by_value_and_start_only_within_the_budget():
    assert plan.ordered(["tiles_speed", "drafter_step", "gpu_tests", "drafter_speed"]) == \
        ["drafter_speed", "gpu_tests", "drafter_step", "tiles_speed"]
    assert plan.fits("drafter_speed", 0, None) is None and plan.fits("drafter_speed", 0, 540) is None
    assert plan.fits("drafter_speed", 540 - plan.ESTIMATED_S["drafter_speed"], 540) is None
    why = plan.fits("tiles_speed", 400, 540)
    assert "left out for the budget" in why and "140 s of --budget 540 left" in why
    # The default parts, estimated, fit one 10-minute call; the tiles row is off unless named.
    elapsed = 0
    for part in (p for p in plan.ORDER if p not in plan.OFF_UNLESS_NAMED):
        if plan.fits(part, elapsed, plan.DEFAULT_BUDGET_S) is None:
            elapsed += plan.ESTIMATED_S[part]
    assert plan.DEFAULT_BUDGET_S < 600 and elapsed <= plan.DEFAULT_BUDGET_S
    assert plan.OFF_UNLESS_NAMED == ("tiles_speed",) and plan.ORDER[-1] == "tiles_speed"


def test_a_budget_leaves_out_the_parts_it_cannot_fit_and_says_so(tmp_path):
    done = gpu_check("--dry-run", "--budget", "0", "--parts", "training", "drafter_kinds", "--out",
                     str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["ok"] and "left out for the budget" in record["training"]["left_out"]
    assert "left out for the budget" in record["drafter_kinds"]["left_out"]  # skippable: the DSpark part
    assert "training: left out for the budget" in (tmp_path / "gpu_check.txt").read_text()


def test_the_dry_run_times_the_dspark_step_beside_dflash_s_and_prints_the_ratios(tmp_path):
    """Part g on CPU at a tiny width (~5 s of CPU): the DSpark recipe's step, DFlash's and distilled
    DFlash's at its shape, one after another in one process, each step time over DFlash's."""
    assert "drafter_kinds" in plan.ORDER and "drafter_kinds" not in plan.OFF_UNLESS_NAMED
    done = gpu_check("--dry-run", "--parts", "drafter_kinds", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    kinds = record["drafter_kinds"]
    assert record["ok"] and "error" not in kinds and kinds["seconds"] > 0
    dflash, distilled, dspark = kinds["dflash"], kinds["dflash_distilled"], kinds["dspark"]
    assert (dflash["drafter"], distilled["drafter"], dspark["drafter"]) == \
        ("DFlashDrafter", "DFlashDrafter", "DSparkDrafter")
    assert dflash["loss_mix"] == {"ce": 1.0} and distilled["loss_mix"] == {"ce": 0.1, "tvd": 0.9}
    assert dspark["loss_mix"] == {"ce": 0.1, "tvd": 0.9, "bce": 1.0}  # the recipe's mix
    # The distillation terms read the target's last hidden state: one layer more in the features.
    hidden = 64
    assert distilled["features_width"] == dspark["features_width"] == dflash["features_width"] + hidden
    for row in (dflash, distilled, dspark):
        assert row["step_s"] > 0 and row["samples_per_s"] > 0 and len(row["steps_s"]) == 2
        assert row["blocks"] == 2 * 8 and row["loss"] > 0 and row["predicted_gib"] > 0
        assert row["modelled_h200_step_s"] is None  # the H200 pace is Qwen3-8B's, not the dry width's
    assert dflash["time_ratio"] == 1.0
    assert dspark["time_ratio"] == round(dspark["step_s"] / dflash["step_s"], 3)
    assert 1 < distilled["modelled_ratio"] < dspark["modelled_ratio"]
    table = (tmp_path / "gpu_check.txt").read_text()
    assert "g. the drafter step by kind (configs/qwen3-8b-dspark.yaml: 2 layers, H 64" in table
    assert "Markov rank 8" in table and "x dflash | modelled x" in table
    (line,) = [line for line in table.splitlines() if line.strip().startswith("dspark |")]
    assert f"| {dspark['time_ratio']:>8} | {dspark['modelled_ratio']:>10} |" in line


def test_the_dspark_part_s_shapes_are_the_recipe_s_and_its_cost_is_modelled_at_qwen3_8b(tmp_path):
    from benchmarks.gpu_check import predicted_peaks
    from benchmarks.gpu_check_drafter import DSPARK_RECIPE, KINDS, STEPS, kind_train_config, modelled
    from dflash_ops.core.config import load_config

    recipe = load_config(DSPARK_RECIPE, check_target=False)
    cfgs = {kind: kind_train_config(kind, "full", tmp_path) for kind in KINDS}
    dspark = cfgs["dspark"]
    assert (dspark.model.kind, dspark.model.markov_rank, dspark.model.confidence_head) == \
        ("dspark", 256, True)
    assert dspark.loss.mix == recipe.loss.mix and cfgs["dflash"].model.kind == "dflash"
    for cfg in cfgs.values():  # one shape for the three: the DSpark recipe's drafter rank
        d = cfg.data
        assert (d.batch_size, d.max_length, d.max_anchors, cfg.model.loss_chunk_size) == \
            (recipe.data.batch_size, recipe.data.max_length, recipe.data.max_anchors, 512)
    cost = {kind: modelled(cfg, "full") for kind, cfg in cfgs.items()}
    # At Qwen3-8B (8 x 3072, 256 anchors): DFlash 37.1 TFLOP a sample; the target's logits for the TVD
    # +4.8; DSpark's Markov head, its extra row a block and the head recomputed +17.2 in all.
    assert cost["dflash"]["flops"] / 1e12 == pytest.approx(37.15, abs=0.01)
    assert cost["dflash_distilled"]["flops"] / cost["dflash"]["flops"] == pytest.approx(1.129, abs=1e-3)
    assert cost["dspark"]["flops"] / cost["dflash"]["flops"] == pytest.approx(1.463, abs=1e-3)
    assert (cost["dflash"]["step_s"], cost["dspark"]["step_s"]) == (0.751, 1.099)  # at the H200 pace
    # The estimate covers the three kinds' steps at the modelled pace twice over, and fits a call alone.
    steps = sum(STEPS["full"]) * sum(c["step_s"] for c in cost.values())
    assert 2 * steps < plan.ESTIMATED_S["drafter_kinds"] < plan.DEFAULT_BUDGET_S
    peaks = {kind: predicted_peaks(cfg, "full")["drafter_step"]["bytes"] / 2**30
             for kind, cfg in cfgs.items()}
    assert peaks["dflash"] < peaks["dflash_distilled"] < peaks["dspark"] < 40  # one H100 holds each


def test_the_toolchain_names_a_missing_compiler_or_one_that_cannot_build_triton_s_launcher(tmp_path):
    bare = {"PATH": str(tmp_path)}  # no gcc, no clang, no CC
    found = plan.toolchain(need_triton=False, env=bare)
    assert found["compiler"] is None and "no C compiler" in found["problems"][0]
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'fatal error: Python.h: No such file or directory' >&2\nexit 1\n")
    broken.chmod(0o755)
    found = plan.toolchain(need_triton=False, env={**bare, "CC": str(broken)})
    (problem,) = found["problems"]
    assert "cannot build a Python extension as Triton does" in problem and "Python.h" in problem
    assert "-shared -fPIC" in problem
    found = plan.toolchain(need_triton=True, env=dict(os.environ))
    if found["triton"] is None:  # the CPU wheel's venv: on a GPU this is a problem, named first
        assert any("Triton is not importable" in p for p in found["problems"])
    assert not [p for p in found["problems"] if "compiler" in p]  # this machine builds it


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_a_toolchain_the_check_fails_first_naming_everything_missing(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "CC": str(tmp_path / "no-such-cc")}
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--out", str(tmp_path / "out")],
                          cwd=REPO, text=True, capture_output=True, timeout=120, env=env)
    assert done.returncode == 1 and "nothing was measured" in done.stderr
    assert "no CUDA device" in done.stderr and "cannot build a Python extension" in done.stderr
    assert not (tmp_path / "out").exists()


def test_the_recipe_prediction_is_the_memory_model_s_drafter_rank_on_one_gpu(tmp_path):
    from benchmarks.gpu_check import RECIPE, TARGET_SHAPE, predicted_peaks, recipe_config
    from dflash_ops.core.config import load_config
    from dflash_ops.training import memory_fit

    cfg = recipe_config("full", tmp_path)
    assert (cfg.model.num_draft_layers, cfg.data.max_length, cfg.data.max_anchors) == (5, 3072, 512)
    assert not cfg.pipeline.is_multi_process  # one GPU: no DDP
    peaks = predicted_peaks(cfg, "full")
    t = TARGET_SHAPE["full"]
    shape = memory_fit.TargetShape(t["layers"], t["hidden"], t["intermediate"], t["heads"], t["kv_heads"],
                                   t["head_dim"], t["vocab"], tied=False)
    recipe = load_config(RECIPE, check_target=False)  # its own layout: 5 target GPUs, 3 drafter GPUs
    (rank,) = [p for p in memory_fit.predict(recipe, shape, runtime_bytes=0) if p.role == "drafter"]
    terms = {name: b for name, b in rank.terms if b}
    step, heldout = peaks["drafter_step"]["terms"], peaks["heldout"]["terms"]
    reserve_growth = heldout["allocator_reserve"] - step["allocator_reserve"]
    assert peaks["heldout"]["bytes"] - peaks["drafter_step"]["bytes"] - reserve_growth == \
        terms["heldout_features"] > 0
    assert reserve_growth == pytest.approx(memory_fit.ALLOCATOR_RESERVE * terms["heldout_features"], abs=1)
    # One GPU: no DDP and no NCCL; the CUDA context is left out (max_memory_reserved does not see it).
    assert set(step) == set(terms) - {"runtime", "ddp_buckets", "nccl_buffers", "heldout_features"}
    assert set(heldout) == set(step) | {"heldout_features"}
    varying = ("feature_queue", "allocator_reserve")
    assert {k: v for k, v in step.items() if k not in varying} == \
        {k: v for k, v in terms.items() if k in step and k not in varying}
    assert 0 < step["feature_queue"] < terms["feature_queue"]  # the batch in training, not the queue


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_the_check_measures_nothing_and_says_so(tmp_path):
    done = gpu_check("--out", str(tmp_path))
    assert done.returncode == 1
    assert "no CUDA device" in done.stderr and "--dry-run" in done.stderr
    assert not list(tmp_path.iterdir())


def test_the_process_s_gpu_memory_is_its_own_line_of_nvidia_smi(tmp_path, monkeypatch):
    from benchmarks.drafter_speed import process_memory_gib

    fake = tmp_path / "nvidia-smi"  # the driver lists every compute process: its pid and MiB
    fake.write_text('#!/bin/sh\necho "1, 99"\necho "$PPID, 2048"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert process_memory_gib() == 2.0
    fake.write_text('#!/bin/sh\necho "1, 99"\n')  # a PID namespace that hides this process
    assert process_memory_gib() is None
