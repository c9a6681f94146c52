"""status.json, which follows the run's log: its one writer, in either layout.

`RunStatus.follow(record)` takes each JSON line of the run's log, in order, and rewrites
`<output_dir>/status.json` (through `StatusFile`, atomically) when the line changes what it shows.
A single-process run's `StatusLog` hands it every event the trainer logs; a pipeline's launcher
hands it its own events and every worker's lines, which reach it on torchrun's stdout. Nothing else
writes status.json, so it never says what the log does not (docs/CONTRACTS.md has its fields).

A start in a directory whose status.json names a checkpoint that is still there resumes that run: its
status.json keeps the old run's step, checkpoint and held-out figures from the first write on, so a start
that fails while loading (a crash, a corrupt checkpoint) says `failed` with its error and loses none of
the run it could not resume; `failed` also keeps the boot resume from starting it again
(module_utils/run_resume.py). A start refused for its config (dflash_ops.training.resume_check) is refused
before this file is touched.

The run's own process (the single-process trainer, or the launcher) logs without a `worker` field;
a single-process run names itself `process_worker` in the workers table. The launcher's stop (the
one event it logs with `"worker": "launcher"`) turns the run and its workers to `stopping`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dflash_ops.core.runtime import EventLog, StatusFile

LAUNCHER = "launcher"  # the `worker` of the launcher's stop event
ACTIVE = ("starting", "running")
RESUMED = ("step", "last_checkpoint", "heldout_loss", "heldout_tau")  # what a resuming start keeps


class RunStatus:
    def __init__(self, output_dir: str | Path, process_worker: str | None = None, metrics=None):
        """`metrics`: a `dflash_ops.run.metrics.RunMetrics` that follows every line too (None: off)."""
        self.process_worker = process_worker
        self.metrics = metrics
        self.workers: dict[str, dict] = {}
        if process_worker is not None:
            self.workers[process_worker] = {"state": "starting", "pid": os.getpid(), "gpus": []}
        self.stopping = False
        self.stop_signal = "SIGTERM"  # the signal of the launcher's stop event, when it names one
        self.drafters_stop_reason = "completed"  # why the drafters stopped (status.json's stop_reason)
        self.lost: str | None = None  # a `checkpoint_lost` line's message: steps trained, not saved
        self.file = StatusFile(output_dir)
        self.file.fields.update(resumed_fields(self.file.path))
        self._write(state="starting")

    def _write(self, **fields) -> None:
        self.file.update(workers={name: dict(w) for name, w in sorted(self.workers.items())}, **fields)

    def _active(self) -> str:
        return "stopping" if self.stopping else "running"

    def _set_worker(self, name: str | None, state: str) -> None:
        if name in self.workers:
            self.workers[name]["state"] = state

    def follow(self, record: dict) -> None:
        """Update status.json for one line of the log (lines that are not events change nothing), and the
        run's metrics file when it has one."""
        self._follow(record)
        if self.metrics is not None and record.get("event"):
            self.metrics.follow(record, self.file.fields)

    def _follow(self, record: dict) -> None:
        event = record.get("event")
        own = "worker" not in record  # a line of the run's own process
        worker = self.process_worker if own else record["worker"]
        if event == "launch":
            self._write(state="starting")
        elif event == "restart":
            self.workers = {}
            self._write(state="stopping" if self.stopping else "starting", restarts=record["restart"])
        elif event == "worker_start":
            self.workers[worker] = {"state": "stopping" if self.stopping else "starting",
                                    "pid": record["pid"], "gpus": list(record.get("gpus", []))}
            self._write()
        elif event == "start":
            self._set_worker(worker, self._active())
            self._write(state=self._active())
        elif event == "step":
            self._write(state=self._active(), **{k: record.get(k) for k in ("step", "loss", "accuracy",
                                                                             "tokens_per_s")})
        elif event == "balance":
            self._write(balance={k: record.get(k) for k in ("target_wait", "drafter_wait", "bound", "split",
                                                             "best_split", "gain", "advice", "target_cost_s",
                                                             "drafter_cost_s")})
        elif event == "heldout":
            self._write(heldout_loss=record.get("heldout_loss"), heldout_tau=record.get("heldout_tau"))
        elif event == "resume":
            self._write(step=record["step"], last_checkpoint=record.get("checkpoint"))
        elif event == "checkpoint":
            # Written on a thread, a checkpoint may be logged after later steps: the step never goes back.
            step = max(record["step"], self.file.fields.get("step") or 0)
            self._write(step=step, last_checkpoint=record.get("path"), checkpoint_error=None)
        elif event == "checkpoint_failed":
            self._write(checkpoint_error=record.get("message"))
        elif event == "checkpoint_lost":  # the run ends failed, whatever else it says
            self.lost = record.get("message")
            self._write(step=record.get("step"), error=self.lost)
        elif event == "stop":
            self._on_stop(worker, own, record)
        elif event == "error" and own:
            self._set_worker(worker, "failed")
            self._write(state="failed", error=record.get("message"))
        elif event == "worker_exit":
            self._set_worker(worker, "exited" if record.get("returncode") == 0 else "failed")
            self._write()
        elif event == "exit":
            if record.get("returncode") == 0 and self.lost is None:
                self._write(state="stopped", stop_reason=f"signal {self.stop_signal}" if self.stopping
                            else self.drafters_stop_reason)
            else:
                self._write(state="failed", error=record.get("error") or self.lost, stop_reason=None)

    def log_error(self, message: str | None) -> None:
        """The log cannot be written (`message`), or can again (None)."""
        self._write(log_error=message)

    def _on_stop(self, worker: str | None, own: bool, record: dict) -> None:
        if worker == LAUNCHER:  # the launcher passes a stop on to the workers
            self.stopping = True
            self.stop_signal = record.get("signal") or self.stop_signal
            for w in self.workers.values():
                if w["state"] in ACTIVE:
                    w["state"] = "stopping"
            self._write(state="stopping")
            return
        self._set_worker(worker, "stopped")
        if own and self.lost is not None:  # a single-process run stops with steps no checkpoint holds
            self._write(state="failed", step=record.get("step"), error=self.lost, stop_reason=None)
        elif own:  # a single-process run has checkpointed and stops
            self._write(state="stopped", step=record.get("step"), stop_reason=record.get("reason"))
        else:
            if worker is not None and worker.startswith("drafter"):
                self.drafters_stop_reason = record.get("reason") or self.drafters_stop_reason
            self._write()


def resumed_fields(path: Path) -> dict:
    """The fields a start keeps of the run it resumes: those of the status.json at `path` when it names a
    checkpoint that is still there, else none."""
    try:
        old = json.loads(path.read_text())
        checkpoint = old.get("last_checkpoint")
    except (OSError, ValueError, AttributeError):
        return {}
    if not checkpoint or not Path(checkpoint).is_dir():
        return {}
    return {key: old.get(key) for key in RESUMED}


class StatusLog(EventLog):
    """The run's log (JSON lines on stdout), with status.json following every event it emits. A log
    that cannot be written (a full disk) is said in status.json's `log_error` (cleared once lines get
    through again): the log itself cannot say it."""

    def __init__(self, total_steps: int, status: RunStatus):
        super().__init__(total_steps, on_log_error=status.log_error)
        self.status = status

    def emit(self, event: str, **fields) -> None:
        super().emit(event, **fields)
        self.status.follow({"event": event, **fields})
