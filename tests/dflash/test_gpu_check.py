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
    assert not [part for part in ("drafter_step", "target_capture", "gpu_tests", "training")
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
    for heading in ("a. drafter step", "b. target capture", "c. pytest -m gpu", "d. training", "nccl"):
        assert heading in table
    assert table in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_the_check_measures_nothing_and_says_so(tmp_path):
    done = gpu_check("--out", str(tmp_path))
    assert done.returncode == 1
    assert "no CUDA device" in done.stderr and "--dry-run" in done.stderr
    assert not list(tmp_path.iterdir())
