"""One writer per run directory: a second trainer on a live run's output_dir is refused at once (exit 2,
naming the holder's pid and host) and changes nothing there; the lock of a killed run is taken over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from dflash_ops.run.main import main as train_main
from dflash_ops.run.run_lock import LOCK_FILE
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[3]


def status_of(out: Path) -> dict:
    try:
        return json.loads((out / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def checkpoints(out: Path) -> list[str]:
    root = out / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def test_a_second_trainer_is_refused_at_once_and_a_dead_holders_lock_is_taken_over(tiny_config, tmp_path,
                                                                                    capsys):
    out = tmp_path / "run"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(out, optim={"total_steps": 400},
                                                 run={"save_every": 2, "step_delay": 0.05})))
    first = subprocess.Popen([sys.executable, "-m", "dflash_ops.train", "--config", str(config)], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=(tmp_path / "first.err").open("w"),
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        # Running, with a checkpoint a second trainer would resume from.
        assert wait_for(lambda: status_of(out).get("state") == "running" and checkpoints(out), timeout=120)
        assert train_main(["--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert f"pid {first.pid} on host {socket.gethostname()}" in err and "in use by another trainer" in err
        assert "Traceback" not in err
        # The first run goes on, alone: status.json is its own (nothing resumed or restarted there).
        assert wait_for(lambda: status_of(out).get("step", 0) >= 6, timeout=120)
        assert status_of(out)["pid"] == first.pid and first.poll() is None
    finally:
        first.send_signal(signal.SIGKILL)  # a holder that cannot unlock: the kernel drops its flock
        first.wait(timeout=60)
    left = json.loads((out / LOCK_FILE).read_text())
    assert left["pid"] == first.pid  # what the dead holder wrote stays until the next one takes over
    config.write_text(yaml.safe_dump(tiny_config(out, optim={"total_steps": 400},
                                                 run={"save_every": 2, "max_steps_per_run": 1})))
    assert train_main(["--config", str(config)]) == 0
    assert "in use by another trainer" not in capsys.readouterr().err
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
