"""Which worker the launcher names when a run fails: the one whose own error started it, whichever
worker torchrun happens to see exit first (the others fail after it, having lost a peer)."""

import json

import pytest

from dflash.config import load_config
from dflash.launcher import Launcher

PIPELINE = {"target_workers": 2, "drafter_workers": 1, "threads_per_worker": 1}  # drafter0, target0, target1


@pytest.fixture
def launcher(write_config):
    path = write_config("failures", pipeline=PIPELINE)
    launcher = Launcher(load_config(path), str(path))
    for local_rank, pid in enumerate((101, 102, 103)):
        launcher._on_line(json.dumps({"event": "worker_start", "local_rank": local_rank, "pid": pid}))
    return launcher


def torchrun_reports(launcher, local_rank, pid, exitcode=1):
    launcher._on_stderr(f"failed (exitcode: {exitcode}) local_rank: {local_rank} (pid: {pid}) of binary: x")


def test_the_first_worker_to_report_an_error_is_named_though_torchrun_sees_another_exit_first(launcher):
    launcher._on_line(json.dumps({"event": "error", "worker": "target1", "message": "injected failure"}))
    launcher._on_line(json.dumps({"event": "error", "worker": "drafter0", "message": "peer lost"}))
    torchrun_reports(launcher, local_rank=0, pid=101)
    assert launcher.last_failure == "worker target1 (pid 103) failed: injected failure"


def test_the_worker_torchrun_names_keeps_its_exit_when_it_reported_first(launcher):
    launcher._on_line(json.dumps({"event": "error", "worker": "target1", "message": "injected failure"}))
    torchrun_reports(launcher, local_rank=2, pid=103, exitcode=-9)
    assert launcher.last_failure.startswith("worker target1 (pid 103) was ")
    assert launcher.last_failure.endswith(": injected failure")


def test_a_worker_killed_by_a_signal_is_the_cause_though_a_peer_reported_first(launcher):
    """SIGKILL (an OOM kill) leaves the victim no word of its own; its peers then report a lost peer."""
    launcher._on_line(json.dumps({"event": "error", "worker": "drafter0", "message": "peer lost"}))
    torchrun_reports(launcher, local_rank=2, pid=103, exitcode=-9)
    assert launcher.last_failure.startswith("worker target1 (pid 103) was ")
    assert "SIGKILL" in launcher.last_failure


def test_without_a_reported_error_torchruns_report_is_the_cause(launcher):
    torchrun_reports(launcher, local_rank=1, pid=102)
    assert launcher.last_failure.startswith("worker target0 (pid 102) failed with ")
