"""A run trained by the trainer of an earlier release resumes under this one: the checkpoint format is
a contract (docs/CONTRACTS.md), not an accident of the package's layout. The earlier trainer is
96e5340's (the flat `dflash/`, before the layers and the rename), taken from this repository's own history."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from dflash_ops.training.checkpoint import latest_checkpoint, load_checkpoint

REPO = Path(__file__).resolve().parents[3]
EARLIER = "96e5340"  # the last tree with the flat package


def earlier_trainer(into: Path) -> Path:
    """The earlier release's `dflash/` (the package's name then) unpacked into `into`; skips without
    history."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", EARLIER, "dflash"],
                             capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"{EARLIER} is not in this checkout's history (a shallow clone)")
    into.mkdir(parents=True)
    tar_path = into.parent / "earlier.tar"
    tar_path.write_bytes(archive.stdout)
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")
    return into


def train(code: Path, config: Path, package: str = "dflash_ops") -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", f"{package}.train", "--config", str(config)], cwd=code,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(code)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_a_run_the_earlier_trainer_checkpointed_resumes_at_its_saved_step_plus_one(tiny_config, tmp_path):
    earlier = earlier_trainer(tmp_path / "earlier")
    out = tmp_path / "run"
    config = tmp_path / "config.yaml"
    raw = tiny_config(out, optim={"total_steps": 6}, run={"max_steps_per_run": 3, "log_every": 1})
    config.write_text(yaml.safe_dump(raw))
    first = train(earlier, config, package="dflash")
    assert [e["step"] for e in first if e["event"] == "step"] == [1, 2, 3]
    second = train(REPO, config)
    resumed = [e for e in second if e["event"] == "resume"]
    assert resumed and resumed[0]["step"] == 3, second
    assert [e["step"] for e in second if e["event"] == "step"] == [4, 5, 6]
    # Its data position has no count of the batches taken (elastic resume's): they are numbered as they
    # always were, step x drafters, and the checkpoints written now record the count.
    assert [e["batches"] for e in second if e["event"] == "step"] == [[3, 4], [4, 5], [5, 6]]
    _, state, meta = load_checkpoint(latest_checkpoint(out))
    assert state["data"]["batches"] == 6 and meta["data_position"] == state["data"]
