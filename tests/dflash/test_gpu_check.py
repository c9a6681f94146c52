"""The GPU check runs end to end on CPU at a tiny width (`--dry-run`) before a GPU sees it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.slow
# Under make test-reliability only: 2.5 min of the benchmark's CPU dry run (a benchmark, not a
# promise of the product).
@pytest.mark.reliability_full
def test_the_dry_run_measures_every_part_and_writes_its_table_and_json(tmp_path):
    done = gpu_check("--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record == json.loads((tmp_path / "gpu_check.json").read_text())
    assert record["ok"] and record["dry_run"]
    assert not [part for part in ("drafter_step", "target_capture", "gpu_tests", "training", "recipe")
                if "error" in record[part]]

    drafter = record["drafter_step"]
    assert drafter["unchunked"]["loss"] == pytest.approx(drafter["chunked"]["loss"], rel=1e-3)
    assert drafter["chunked"]["samples_per_s"] > 0 and drafter["chunked"]["peak_gib"] > 0
    capture = record["target_capture"]
    assert capture["whole_batch"]["tokens_per_s"] > 0 and capture["rows_per_pass_1"]["tokens_per_s"] > 0
    if "summary" in record["gpu_tests"]:  # pytest found: the CUDA tests were selected and skipped
        assert "skipped" in record["gpu_tests"]["summary"]
    training = record["training"]
    assert training["device"] == "cpu" and training["stop"] == "signal SIGTERM"
    assert 3 <= training["stopped_at"] < training["steps"] and training["losses_equal"]

    table = (tmp_path / "gpu_check.txt").read_text()
    for heading in ("a. drafter step", "b. target capture", "c. pytest -m gpu", "d. training",
                    "e. the recipe", "nccl"):
        assert heading in table
    assert table in done.stdout


@pytest.mark.slow
def test_the_dry_run_of_the_recipe_measures_its_step_and_held_out_evaluation_beside_the_prediction(tmp_path):
    done = gpu_check("--dry-run", "--parts", "recipe", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["ok"] and set(record) >= {"recipe"} and "training" not in record  # that part alone
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
    table = (tmp_path / "gpu_check.txt").read_text()
    assert "e. the recipe's drafter rank (configs/qwen3-8b.yaml: 2 layers" in table
    assert "drafter_step |" in table and "heldout |" in table and "a. drafter step" not in table


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


@pytest.mark.slow
def test_the_dry_run_of_the_drafter_speed_part_runs_each_backend_and_says_which_it_used(tmp_path):
    done = gpu_check("--dry-run", "--parts", "drafter_speed", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record["ok"] and "recipe" not in record  # that part alone
    speed = record["drafter_speed"]
    auto, tiles = speed["auto"], speed["tiles"]
    # torch has no FlexAttention backward on CPU: there auto is the tiles, and says why.
    assert auto["backend"] == tiles["backend"] == "tiles" and "backward" in auto["reason"]
    for row in (auto, tiles):
        assert row["samples_per_s"] > 0 and row["tokens_per_s"] > 0 and row["blocks"] == 2 * 8
        assert row["new_graphs_after_warmup"] == 0
    assert len(auto["steps_s"]) == 4 and len(tiles["steps_s"]) == 1  # the tiles: one measured step
    assert auto["loss"] == pytest.approx(tiles["loss"], rel=1e-2)  # same weights, data and anchors
    assert speed["reference"]["samples_per_s"] == 8.7 and speed["speedup"] > 0
    table = (tmp_path / "gpu_check.txt").read_text()
    assert "f. the drafter step by attention backend (2 layers, H 64, batch 2 x 64" in table
    assert "speed-up over the tiles" in table and "a. drafter step" not in table


def test_the_process_s_gpu_memory_is_its_own_line_of_nvidia_smi(tmp_path, monkeypatch):
    from benchmarks.drafter_speed import process_memory_gib

    fake = tmp_path / "nvidia-smi"  # the driver lists every compute process: its pid and MiB
    fake.write_text('#!/bin/sh\necho "1, 99"\necho "$PPID, 2048"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert process_memory_gib() == 2.0
    fake.write_text('#!/bin/sh\necho "1, 99"\n')  # a PID namespace that hides this process
    assert process_memory_gib() is None
