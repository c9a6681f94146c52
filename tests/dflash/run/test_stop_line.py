"""A run's `stop` line says when its stop was requested (`signalled_at`): from there to the exit is the run's
own stop, and a restart's GPU idle window starts there (benchmarks/restart_cycle.py): until the signal the
old run trains."""

from __future__ import annotations

import json
import os
import signal
import time

from dflash_ops.core.config import config_from_dict
from dflash_ops.core.runtime import StopSignal
from dflash_ops.run.main import run_single_process
from tests.waiting import wait_for


def test_the_stop_line_says_when_the_signal_came(tiny_config, tmp_path, capsys):
    stop = StopSignal().install()
    before = time.time()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert wait_for(lambda: stop.requested, 5, interval=0.01)
        assert before <= stop.signalled_at <= time.time()
        os.kill(os.getpid(), signal.SIGTERM)  # a second signal is not a new request: the first one's time
        signalled = stop.signalled_at
        code = run_single_process(config_from_dict(tiny_config(tmp_path / "run")), stop)
    finally:
        stop.restore()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    (line,) = [record for record in lines if record["event"] == "stop"]
    assert code == 0 and line["reason"] == "signal SIGTERM"
    assert line["signalled_at"] == round(signalled, 3) and line["signalled_at"] <= line["time"]


def test_a_run_that_ends_without_a_signal_says_no_signal_time(tiny_config, tmp_path, capsys):
    code = run_single_process(config_from_dict(tiny_config(tmp_path / "run", optim={"total_steps": 1})))
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    (line,) = [record for record in lines if record["event"] == "stop"]
    assert code == 0 and line["reason"] == "completed" and "signalled_at" not in line
