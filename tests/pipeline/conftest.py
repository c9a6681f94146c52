"""Fixtures for the pipeline, evaluation and demo tests: the tiny demo assets, config files, and
runs of `python -m dflash_ops.train` in their own process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pvesim.fleet import prepare_assets
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def demo_dir() -> Path:
    """The tiny demo assets the sim tests use too: built once and reused across test sessions."""
    return prepare_assets()


@pytest.fixture
def write_config(demo_dir, tmp_path):
    """Factory: `write_config(name, run={...}, pipeline={...}, ...)` -> the path of a config that
    trains on the tiny demo, with its output in tmp_path/name; keyword arguments update sections."""

    def make(name: str, **sections) -> Path:
        raw = yaml.safe_load((demo_dir / "config.yaml").read_text())
        raw["data"].update(batch_size=4, max_anchors=16)
        raw["optim"].update(total_steps=12, warmup_ratio=0.0)
        raw["run"].update(output_dir=str(tmp_path / name), save_every=1000, log_every=1)
        for section, values in sections.items():
            raw[section].update(values)
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw))
        return path

    return make


class TrainProcess:
    """`python -m dflash_ops.train` started as its own process group, as `run.sh` runs it."""

    def __init__(self, config: Path, log: Path, env: dict | None = None):
        self.config, self.log_path = config, log
        self.output_dir = Path(yaml.safe_load(config.read_text())["run"]["output_dir"])
        self.process = subprocess.Popen(
            [sys.executable, "-m", "dflash_ops.train", "--config", str(config)],
            cwd=REPO, env={**os.environ, **(env or {})}, stdout=log.open("w"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pgid = self.process.pid

    def status(self) -> dict | None:
        try:
            return json.loads((self.output_dir / "status.json").read_text())
        except (OSError, ValueError):
            return None

    def wait_for(self, predicate, timeout: float) -> dict:
        """The run's status once `predicate(status)` holds; fails at once if the run exits first."""
        def held():
            status = self.status()
            if status is not None and predicate(status):
                return status
            if self.process.poll() is not None:
                raise AssertionError(f"the run exited ({self.process.returncode}) before the condition "
                                     f"held:\n{self.log_path.read_text()[-3000:]}")
            return None

        status = wait_for(held, timeout, interval=0.1)
        assert status, f"timed out waiting; last status {self.status()}"
        return status

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def events(self) -> list[dict]:
        records = []
        for line in self.log_path.read_text().splitlines():
            if line.startswith("{"):
                records.append(json.loads(line))
        return records

    def group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        return True

    def kill(self) -> None:
        """Leave nothing behind, whatever the test did."""
        if self.group_alive():
            os.killpg(self.pgid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait(timeout=10)


@pytest.fixture
def start_run(tmp_path):
    """Factory: `start_run(config, env=None)` -> a TrainProcess; every run is killed at teardown."""
    runs: list[TrainProcess] = []

    def start(config: Path, env: dict | None = None) -> TrainProcess:
        run = TrainProcess(config, tmp_path / f"{config.stem}-{len(runs)}.log", env)
        runs.append(run)
        return run

    yield start
    for run in runs:
        run.kill()


def _pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def pid_alive():
    """`pid_alive(pid)`: True while the process exists and is not a zombie."""
    return _pid_alive
