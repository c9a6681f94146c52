"""Which worker the launcher names when a start of the group fails: the one whose own error report
(torchrun's per-rank error file) was written first, whichever worker torchrun happens to see exit
first (the others fail after it, having lost a peer); or the one torchrun saw killed by a signal,
which writes no report."""

import io
import json
import os

import pytest
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from dflash_ops.core.config import load_config
from dflash_ops.run.launcher import Launcher

PIPELINE = {"target_workers": 2, "drafter_workers": 1, "threads_per_worker": 1}  # drafter0, target0, target1
PIDS = {"drafter0": 101, "target0": 102, "target1": 103}


@pytest.fixture
def launcher(write_config, tmp_path):
    path = write_config("failures", pipeline=PIPELINE)
    launcher = Launcher(load_config(path), str(path))
    for local_rank, (name, pid) in enumerate(PIDS.items()):
        launcher._on_line(json.dumps({"event": "worker_start", "worker": name, "local_rank": local_rank,
                                      "pid": pid, "error_file": str(tmp_path / f"{name}.json")}))
    return launcher


@pytest.fixture
def report(launcher, monkeypatch):
    """`report(name, message, at)`: the worker writes its error file as a worker of torchrun does
    (torch's error handler, to TORCHELASTIC_ERROR_FILE), stamped `at` seconds into the test."""

    def write(name: str, message: str, at: float) -> None:
        path = launcher.workers[name].error_file
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", path)
        try:
            raise RuntimeError(message)
        except RuntimeError as exc:
            ErrorHandler().record_exception(exc)
        stamp = 1_700_000_000_000_000_000 + int(at * 1e9)
        os.utime(path, ns=(stamp, stamp))

    return write


def torchrun_reports(launcher, local_rank, pid, exitcode=1):
    launcher._on_stderr(f"failed (exitcode: {exitcode}) local_rank: {local_rank} (pid: {pid}) of binary: x")


def test_the_first_report_written_is_named_though_torchrun_sees_another_exit_first(launcher, report):
    report("drafter0", "peer lost", at=0.002)
    report("target1", "injected failure", at=0.001)  # written first, whatever the order they are read in
    torchrun_reports(launcher, local_rank=0, pid=101)
    assert launcher.start_failure() == "worker target1 (pid 103) failed: RuntimeError: injected failure"


def test_a_worker_killed_after_its_report_keeps_its_signal_and_its_message(launcher, report):
    report("target1", "injected failure", at=0.001)
    torchrun_reports(launcher, local_rank=2, pid=103, exitcode=-9)
    assert launcher.start_failure() == ("worker target1 (pid 103) was killed by SIGKILL: "
                                        "RuntimeError: injected failure")


def test_a_worker_killed_by_a_signal_is_the_cause_though_a_peer_reported_first(launcher, report):
    """SIGKILL (an OOM kill) leaves the victim no word of its own; its peers then report a lost peer."""
    report("drafter0", "peer lost", at=0.001)
    torchrun_reports(launcher, local_rank=2, pid=103, exitcode=-9)
    assert launcher.start_failure() == "worker target1 (pid 103) was killed by SIGKILL"
    # It could not log its own exit: the launcher logs it from torchrun's word, and status.json follows.
    status = json.loads(launcher.status.file.path.read_text())
    assert status["workers"]["target1"]["state"] == "failed"
    assert status["workers"]["drafter0"]["state"] == "starting"


def test_without_a_report_torchruns_word_is_the_cause(launcher):
    torchrun_reports(launcher, local_rank=1, pid=102)
    assert launcher.start_failure() == "worker target0 (pid 102) failed with exit status 1"


def test_a_restart_names_the_failed_start_and_forgets_it(launcher, report):
    report("target1", "injected failure", at=0.001)
    torchrun_reports(launcher, local_rank=2, pid=103)
    launcher.log.stream = log = io.StringIO()
    launcher._on_line(json.dumps({"event": "worker_start", "worker": "drafter0", "local_rank": 0,
                                  "pid": 201, "restart": 1}))
    # The launcher's own restart event, then the worker's line it passes on (one log, in that order).
    restart, passed_on = [json.loads(line) for line in log.getvalue().splitlines()]
    assert restart["event"] == "restart" and "worker" not in restart
    assert passed_on["event"] == "worker_start" and passed_on["pid"] == 201
    assert restart["cause"] == "worker target1 (pid 103) failed: RuntimeError: injected failure"
    status = json.loads(launcher.status.file.path.read_text())
    assert status["restarts"] == 1 and status["workers"] == {
        "drafter0": {"state": "starting", "pid": 201, "gpus": []}}
    assert launcher.start_failure() is None  # the new start has failed in nothing yet


def test_a_pipeline_whose_final_checkpoint_is_lost_exits_1_and_ends_failed(launcher, capsys):
    """Every worker exits 0 (torchrun too), but drafter 0 could not write the final checkpoint: the run
    exits 1 and status.json says `failed` with the lost steps, never `stopped`."""
    lost = "the run trained to step 6 but its final checkpoint could not be written (No space left on device)"
    for line in ({"event": "checkpoint_lost", "worker": "drafter0", "step": 6, "saved_step": 2,
                  "message": lost},
                 {"event": "stop", "worker": "drafter0", "step": 6, "reason": "completed"},
                 *({"event": "worker_exit", "worker": name, "returncode": 0} for name in PIDS)):
        launcher._on_line(json.dumps(line))
    assert launcher._finish(0) == 1
    assert lost in capsys.readouterr().err
    status = json.loads(launcher.status.file.path.read_text())
    assert (status["state"], status["error"], status["stop_reason"]) == ("failed", lost, None)
