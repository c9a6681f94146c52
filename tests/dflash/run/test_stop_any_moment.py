"""SIGTERM at any moment of a single-process run exits 0 with its checkpoint: while the config loads (before
the run: nothing started), during the final save, and in the run's last instant (the lock let go, the
interpreter about to exit), where the default action used to end the process 143 after "completed".
Each stop is sent by the process to itself at that point (a patched function), so that the moment is
exact whatever the machine's load; both command spellings (`python -m dflash_ops.train`, `python -m
dflash_ops train`) are the real entry points, run by runpy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_ops.training.checkpoint import list_checkpoints, step_of

REPO = Path(__file__).resolve().parents[3]

WRAPPER = '''
import os, runpy, signal, sys

moment, module, *args = sys.argv[1:]


def stop_then(original):
    def patched(*a, **k):
        if moment != "final_save" or a[1] == 3:  # save_checkpoint(output_dir, step, ...): the last step's
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*a, **k)
    return patched


if moment == "config":
    from dflash_ops.run import main
    main.load_config = stop_then(main.load_config)
elif moment == "final_save":
    from dflash_ops.training import drafter_run
    drafter_run.save_checkpoint = stop_then(drafter_run.save_checkpoint)
elif moment == "exit":
    from dflash_ops.run import run_lock
    run_lock.RunLock.release = stop_then(run_lock.RunLock.release)
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__", alter_sys=True)
'''


TRAIN, DISPATCHER = ("dflash_ops.train",), ("dflash_ops", "train")


@pytest.mark.parametrize(("moment", "entry"), [("config", TRAIN), ("final_save", TRAIN), ("exit", TRAIN),
                                               ("exit", DISPATCHER)])
def test_sigterm_at_any_moment_exits_0_with_the_checkpoint(moment, entry, tiny_config, tmp_path):
    out = tmp_path / "run"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(out, optim={"total_steps": 3}, run={"save_every": 1000})))
    wrapper = tmp_path / "stop_at.py"
    wrapper.write_text(WRAPPER)
    result = subprocess.run([sys.executable, str(wrapper), moment, *entry, str(config)], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    if moment == "config":
        assert "SIGTERM before the run began: nothing started" in result.stderr
        assert not any(e["event"] == "step" for e in events) and not list_checkpoints(out)
        return
    assert [step_of(p) for p in list_checkpoints(out)] == [3]
    assert events[-1]["event"] == "stop" and events[-1]["reason"] == "completed"
