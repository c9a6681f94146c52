"""One writer per run directory, in a pipeline: the launcher holds `train.lock` and torchrun holds it
with it, so a second trainer is refused while the pipeline runs, and the lock is free once it stopped."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

from dflash_ops.run.main import main as train_main
from dflash_ops.run.run_lock import LOCK_FILE, RunLock

PIPELINE = {"device": "cpu", "target_workers": 1, "drafter_workers": 1, "threads_per_worker": 1}


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def holds(pid: int, path: Path) -> bool:
    fds = Path(f"/proc/{pid}/fd")
    return any(os.path.realpath(fd) == str(path) for fd in fds.iterdir())


def test_a_second_trainer_is_refused_while_a_pipeline_runs(write_config, start_run, capsys):
    config = write_config("locked", optim={"total_steps": 200}, run={"step_delay": 0.2}, pipeline=PIPELINE)
    run = start_run(config)
    run.wait_for(lambda s: s["state"] == "running" and s.get("step", 0) >= 1, timeout=180)
    lock = (run.output_dir / LOCK_FILE).resolve()
    (torchrun,) = children(run.process.pid)
    assert holds(run.process.pid, lock) and holds(torchrun, lock)

    assert train_main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert f"pid {run.process.pid} on host {socket.gethostname()}" in err and "Traceback" not in err

    os.killpg(run.pgid, signal.SIGTERM)
    assert run.wait(timeout=120) == 0, run.log_path.read_text()[-3000:]
    assert run.status()["state"] == "stopped"
    with RunLock(run.output_dir):  # free once the launcher and torchrun are gone
        pass
