"""A run's params and metrics in MLflow, for a config that names a tracking server.

`run.mlflow_uri` (`http://mlflow.lab:5000`), or `run.report_to: [mlflow]` (SpecForge's tracker names) with
the server from the run's `MLFLOW_TRACKING_URI`, turns it on; `run.mlflow_experiment` names the experiment
(made when missing). The process that writes the run's files (drafter rank 0) opens one MLflow run per
training run: its id is kept in `<output_dir>/mlflow_run.json`, so a resumed run (a restart, a torchrun
restart) goes on in the same MLflow run. Its params are the config's keys (`model.hidden_size`, ...); its
metrics the scalars of every record of metrics.jsonl under TensorBoard's names (`train/loss`,
`heldout/heldout_tau`), at the run's step. After a resume the steps redone since the last checkpoint are
logged again (MLflow keeps both values of a step; metrics.jsonl's later line wins).

Nothing of it runs in the training loop: records go to a queue that a thread sends, so a slow or
unreachable server costs figures (said once in the log as a warning, and again when it answers), never a
step. At the end the queue is sent (at most `CLOSE_SECONDS`) and the MLflow run is marked finished.

The client is the `mlflow-skinny` package (`pip install 'dflash-ops[mlflow]'`), imported only when a config
asks for it: a run without it imports nothing of MLflow. `python -m dflash_ops.config validate` refuses a
config that asks for it in a venv without it (`check_installed`), before a deploy stops anything."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import queue
import threading
import time
from pathlib import Path

from dflash_ops.core.runtime import FILE_MODE, ensure_dir, output_mode
from dflash_ops.core.safe_paths import open_file
from dflash_ops.core.sections import ConfigError
from dflash_ops.training.telemetry import scalars

RUN_FILE = "mlflow_run.json"
CLOSE_SECONDS = 30.0
QUEUE_RECORDS = 10_000  # past it, records are dropped (and counted) until the thread catches up
# MLflow's limits (mlflow.utils.validation): params and metrics per log_batch call, a param value's length.
BATCH_PARAMS, BATCH_METRICS, PARAM_LENGTH = 100, 1000, 6000
# The client's HTTP retries and timeout unless the run's environment sets them: MLflow's defaults retry for
# minutes, which would hold the end of a run on a server that is down.
CLIENT_ENVIRONMENT = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
PACKAGE_HINT = ("the mlflow client is not installed in this venv: pip install 'dflash-ops[mlflow]' "
                "(mlflow-skinny; dflash_env_requirements in a container)")


def wanted(run_cfg) -> bool:
    """Whether the config asks for MLflow."""
    return bool(run_cfg.mlflow_uri) or "mlflow" in run_cfg.report_to


def check_installed(run_cfg) -> None:
    """ConfigError when the config asks for MLflow and its client cannot be imported here."""
    if wanted(run_cfg) and importlib.util.find_spec("mlflow") is None:
        key = "run.mlflow_uri" if run_cfg.mlflow_uri else "run.report_to"
        raise ConfigError(key, PACKAGE_HINT)


def params_of(cfg) -> dict[str, str]:
    """The config's keys as MLflow params: `section.key` -> its value as text (JSON for lists and maps)."""
    params = {}
    for section in ("model", "data", "optim", "run", "pipeline"):
        for key, value in dataclasses.asdict(getattr(cfg, section)).items():
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
            params[f"{section}.{key}"] = text[:PARAM_LENGTH]
    return params


def chunks(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


class MlflowRun:
    """The thread that sends a training run's params and records to MLflow."""

    def __init__(self, cfg, output_dir: Path, warn):
        try:
            from mlflow.entities import Metric, Param, RunStatus
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ConfigError("run.mlflow_uri" if cfg.run.mlflow_uri else "run.report_to",
                              f"{PACKAGE_HINT} ({exc})") from None
        self._metric, self._param, self._status = Metric, Param, RunStatus
        for name, value in CLIENT_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        self.uri = cfg.run.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
        self.client = MlflowClient(tracking_uri=self.uri) if self.uri else None
        self.cfg, self.output_dir, self.warn = cfg, output_dir, warn
        self.run_id: str | None = None
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_RECORDS)
        self.dropped = 0
        self.failure: str | None = None  # the server's last error, while it lasts (the thread's)
        self.said: str | None = None  # the failure the log last said (the caller's)
        if self.client is None:
            warn("run.report_to names mlflow but neither run.mlflow_uri nor MLFLOW_TRACKING_URI says where "
                 "its server is: nothing is sent to MLflow")
            return
        self.thread = threading.Thread(target=self._send, name="mlflow", daemon=True)
        self.thread.start()

    def record(self, kind: str, step: int, figures: dict) -> None:
        self._say()
        if self.client is None:
            return
        try:
            self.queue.put_nowait((int(time.time() * 1000), step, scalars(kind, figures)))
        except queue.Full:
            self.dropped += 1

    def close(self, status: str = "FINISHED") -> None:
        if self.client is None:
            return
        self.queue.put((None, None, status))
        self.thread.join(CLOSE_SECONDS)
        self._say()
        if self.thread.is_alive():
            self.warn(f"MLflow at {self.uri} took more than {CLOSE_SECONDS:.0f} s to take the run's last "
                      "figures: the rest are in metrics.jsonl only")

    def _say(self) -> None:
        """Tell the log when the server starts failing and when it answers again (in the caller's thread)."""
        failure = self.failure
        if failure != self.said:
            if failure:
                self.warn(f"MLflow at {self.uri} fails ({failure}): figures are not sent to it until it "
                          "answers; metrics.jsonl has them")
            else:
                self.warn(f"MLflow at {self.uri} answers again")
            self.said = failure
        if self.dropped:
            self.warn(f"{self.dropped} records were not sent to MLflow (its queue was full)")
            self.dropped = 0

    def _attempt(self, action) -> bool:
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - whatever the client raises costs figures, never the run
            self.failure = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            return False
        self.failure = None
        return True

    def _send(self) -> None:
        while True:
            timestamp, step, payload = self.queue.get()
            if timestamp is None:
                if self.run_id is not None:
                    self._attempt(lambda status=payload: self.client.set_terminated(self.run_id, status))
                return
            if self.run_id is None and not self._attempt(self._open):
                continue
            metrics = [self._metric(tag, float(value), timestamp, step) for tag, value in payload.items()]
            for part in chunks(metrics, BATCH_METRICS):
                self._attempt(lambda part=part: self.client.log_batch(self.run_id, metrics=part))

    def _open(self) -> None:
        """The MLflow run of this training run: the one `mlflow_run.json` names on this server (running
        again), else a new one in the experiment; its params, those it lacks."""
        saved = self.output_dir / RUN_FILE
        try:
            with os.fdopen(open_file(saved, os.O_RDONLY, 0), "r") as f:
                known = json.loads(f.read())
        except FileNotFoundError:
            known = {}
        if known.get("uri") == self.uri and known.get("run_id"):
            run = self.client.get_run(known["run_id"])
            self.client.update_run(run.info.run_id, status=self._status.to_string(self._status.RUNNING))
        else:
            name = self.cfg.run.mlflow_experiment
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
            run = self.client.create_run(experiment_id, run_name=Path(self.cfg.run.output_dir).name,
                                         tags={"dflash.output_dir": self.cfg.run.output_dir})
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            with os.fdopen(open_file(ensure_dir(self.output_dir) / RUN_FILE, flags, FILE_MODE), "w") as f:
                os.fchmod(f.fileno(), output_mode(FILE_MODE))
                f.write(json.dumps({"uri": self.uri, "run_id": run.info.run_id}) + "\n")
        have = run.data.params
        params = [self._param(k, v) for k, v in params_of(self.cfg).items() if k not in have]
        for part in chunks(params, BATCH_PARAMS):
            self.client.log_batch(run.info.run_id, params=part)
        self.run_id = run.info.run_id


class TrackedTelemetry:
    """A run's telemetry whose records also go to MLflow."""

    def __init__(self, telemetry, mlflow_run: MlflowRun):
        self.telemetry, self.mlflow_run = telemetry, mlflow_run

    def record(self, kind: str, step: int, figures: dict) -> None:
        self.telemetry.record(kind, step, figures)
        self.mlflow_run.record(kind, step, figures)

    def close(self) -> None:
        self.telemetry.close()
        self.mlflow_run.close()

    def __getattr__(self, name):
        return getattr(self.telemetry, name)


def track(telemetry, cfg, enabled: bool, warn):
    """`telemetry` itself when the config names no MLflow (nothing imported) or this process records
    nothing (`enabled` false: a drafter rank other than 0); else it, its records also sent to MLflow."""
    if not enabled or not wanted(cfg.run):
        return telemetry
    return TrackedTelemetry(telemetry, MlflowRun(cfg, Path(cfg.run.output_dir), warn))
