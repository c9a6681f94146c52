"""The launcher: the process that *is* a multi-process run.

`run.sh` execs `python -m dflash.train --config <yaml>`; when the config's `pipeline` section asks
for workers, that process becomes this launcher. It

- resolves the layout (one worker per target GPU and per drafter GPU, or `target_workers` /
  `drafter_workers` on CPU) and refuses a layout that overlaps or exceeds the visible GPUs;
- starts the workers (`python -m dflash.pipeline`) in its own process group, each with its own
  `CUDA_VISIBLE_DEVICES` and thread count, rendezvousing on a free loopback port;
- forwards every worker's JSON log lines to its stdout (tagged with the worker's name) and keeps
  the last lines of each worker's stderr for error reports;
- owns `status.json` (step, loss, accuracy, tokens/s, last checkpoint, per-worker state);
- on SIGTERM/SIGINT forwards SIGTERM to the workers (the drafters checkpoint, then every worker
  exits) and exits 0 once all of them have exited cleanly;
- when a worker fails, stops the others (SIGTERM, then SIGKILL after a grace period), logs the
  worker's error and exits 1. Nothing is started outside the process group, nothing is left behind.

It imports no torch: it stays small and answers signals at once.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash.config import ConfigError, PipelineConfig, TrainConfig
from dflash.devices import visible_devices
from dflash.runtime import EventLog, StatusFile

# Seconds the other workers get to exit after one failed, before SIGKILL.
FAILURE_GRACE_S = float(os.environ.get("DFLASH_FAILURE_GRACE_S", "10"))
STDERR_TAIL_LINES = 40
POLL_INTERVAL_S = 0.05


@dataclass(frozen=True)
class WorkerSpec:
    """One worker process of the layout."""

    name: str  # target0, target1, drafter0...
    role: str  # "target" | "drafter"
    role_rank: int  # index among the workers of its role
    rank: int  # global torch.distributed rank: drafters first, so rank 0 is drafter 0
    gpus: tuple[int, ...]  # the layout's GPU indices (into the launcher's visible GPUs); () on CPU


def plan_workers(pipeline: PipelineConfig, n_visible_gpus: int) -> list[WorkerSpec]:
    """The workers of a layout, or ConfigError when it names GPUs that are not visible here.
    (PipelineConfig already refused layouts that cannot run anywhere.)"""
    pipeline.check_visible_gpus(n_visible_gpus)
    if pipeline.device == "cuda":
        targets = [(g,) for g in pipeline.target_gpus]
        drafters = [(g,) for g in pipeline.drafter_gpus]
    else:
        targets = [()] * pipeline.target_workers
        drafters = [()] * pipeline.drafter_workers
    specs = [WorkerSpec(f"drafter{i}", "drafter", i, i, gpus) for i, gpus in enumerate(drafters)]
    first_target = len(drafters)
    specs += [WorkerSpec(f"target{i}", "target", i, first_target + i, gpus) for i, gpus in enumerate(targets)]
    return specs


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_environment(spec: WorkerSpec, world_size: int, port: int, pipeline: PipelineConfig,
                       n_targets: int, n_drafters: int, devices: list[str]) -> dict[str, str]:
    """The worker's environment: its ranks, the rendezvous, its GPUs (layout index i is the
    launcher's i-th visible device), its thread count."""
    env = dict(os.environ)
    threads = str(pipeline.threads_per_worker)
    env.update({
        "RANK": str(spec.rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "DFLASH_WORKER_NAME": spec.name,
        "DFLASH_WORKER_ROLE": spec.role,
        "DFLASH_ROLE_RANK": str(spec.role_rank),
        "DFLASH_NUM_TARGETS": str(n_targets),
        "DFLASH_NUM_DRAFTERS": str(n_drafters),
        "DFLASH_LAUNCHER_PID": str(os.getpid()),
        # An empty CUDA_VISIBLE_DEVICES hides every GPU from a CPU worker.
        "CUDA_VISIBLE_DEVICES": ",".join(devices[i] for i in spec.gpus),
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "PYTHONUNBUFFERED": "1",
    })
    return env


@dataclass
class Worker:
    spec: WorkerSpec
    process: subprocess.Popen
    state: str = "starting"
    stderr_tail: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=STDERR_TAIL_LINES))
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def returncode(self) -> int | None:
        return self.process.poll()


def _describe_exit(code: int) -> str:
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


class Launcher:
    def __init__(self, cfg: TrainConfig, config_path: str):
        self.cfg = cfg
        self.config_path = str(Path(config_path).resolve())
        self.devices = visible_devices() if cfg.pipeline.device == "cuda" else []
        self.specs = plan_workers(cfg.pipeline, len(self.devices))
        self.status = StatusFile(cfg.run.output_dir)
        self.log = EventLog(cfg.optim.total_steps)
        self.workers: list[Worker] = []
        self.lock = threading.Lock()
        self.stop_requested = False
        self.stop_forwarded = False
        self.failure: str | None = None
        self.kill_deadline: float | None = None

    # --- logging and status -------------------------------------------------------------------
    def emit(self, event: str, **fields) -> None:
        with self.lock:
            self.log.emit(event, **fields)

    def forward(self, record: dict) -> None:
        with self.lock:
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()

    def _worker_table(self) -> dict:
        return {w.spec.name: {"state": w.state, "pid": w.process.pid, "gpus": list(w.spec.gpus)}
                for w in self.workers}

    def update_status(self, **fields) -> None:
        with self.lock:
            self.status.update(workers=self._worker_table(), **fields)

    def _on_worker_line(self, worker: Worker, line: str) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or "event" not in record:
            with self.lock:
                sys.stdout.write(f"[{worker.spec.name}] {line}\n")
                sys.stdout.flush()
            return
        record.setdefault("worker", worker.spec.name)
        self.forward(record)
        event = record["event"]
        if event == "start":
            worker.state = "stopping" if self.stop_forwarded else "running"
            self.update_status()
        elif event == "step":
            self.update_status(**{k: record.get(k) for k in ("step", "loss", "accuracy", "tokens_per_s")})
            with self.lock:
                self.log.show_progress(record["step"], record["loss"], record.get("tokens_per_s") or 0.0)
        elif event == "heldout":
            self.update_status(heldout_loss=record.get("heldout_loss"), heldout_tau=record.get("heldout_tau"))
        elif event in ("checkpoint", "resume"):
            path = record.get("path") or record.get("checkpoint")
            self.update_status(step=record.get("step"), last_checkpoint=path)
        elif event == "stop":
            worker.state = "stopped"
            self.update_status()
        if event == "stop" and worker.spec.role == "drafter":
            # The drafters have checkpointed and stop: the targets must stop feeding them.
            self.ask_to_stop([w for w in self.workers if w.spec.role == "target"])

    def _pump_stdout(self, worker: Worker) -> None:
        for raw in worker.process.stdout:
            self._on_worker_line(worker, raw.rstrip("\n"))

    def _pump_stderr(self, worker: Worker) -> None:
        for raw in worker.process.stderr:
            line = raw.rstrip("\n")
            worker.stderr_tail.append(line)
            with self.lock:
                sys.stderr.write(f"[{worker.spec.name}] {line}\n")
                sys.stderr.flush()

    # --- lifecycle ----------------------------------------------------------------------------
    def start_workers(self) -> None:
        port = free_loopback_port()
        n_targets = sum(s.role == "target" for s in self.specs)
        n_drafters = len(self.specs) - n_targets
        for spec in self.specs:
            env = worker_environment(spec, len(self.specs), port, self.cfg.pipeline, n_targets, n_drafters,
                                     self.devices)
            process = subprocess.Popen(
                [sys.executable, "-m", "dflash.pipeline", "--config", self.config_path],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, bufsize=1,  # same process group as the launcher: never a new session
            )
            self.workers.append(Worker(spec, process))
        for worker in self.workers:
            for pump in (self._pump_stdout, self._pump_stderr):
                thread = threading.Thread(target=pump, args=(worker,), daemon=True)
                thread.start()
                worker.threads.append(thread)

    def ask_to_stop(self, workers: list[Worker]) -> None:
        """SIGTERM to those of `workers` that have not begun to stop (a worker that is already
        finishing needs no second request)."""
        for worker in workers:
            if worker.returncode is None and worker.state in ("starting", "running"):
                worker.state = "stopping"
                worker.process.send_signal(signal.SIGTERM)
        self.update_status(state="stopping")

    def signal_workers(self, signum: int) -> None:
        for worker in self.workers:
            if worker.returncode is None:
                try:
                    worker.process.send_signal(signum)
                except ProcessLookupError:
                    pass

    def _handle_stop_signal(self, signum, frame) -> None:
        self.stop_requested = True

    def _check_workers(self) -> None:
        for worker in self.workers:
            code = worker.returncode
            if code is None or worker.state in ("exited", "failed"):
                continue
            for thread in worker.threads:  # the pipes close when the process exits
                thread.join(timeout=2)
            worker.state = "exited" if code == 0 else "failed"
            self.emit("worker_exit", worker=worker.spec.name, pid=worker.process.pid, returncode=code)
            if code != 0 and self.failure is None:
                last_error = next((line for line in reversed(worker.stderr_tail) if line.strip()), "")
                self.failure = (f"worker {worker.spec.name} (pid {worker.process.pid}) failed with "
                                f"{_describe_exit(code)}: {last_error or 'no error output'}")
                self.emit("error", worker=worker.spec.name, message=self.failure,
                          stderr_tail="\n".join(worker.stderr_tail))
                self.signal_workers(signal.SIGTERM)
                self.kill_deadline = time.monotonic() + FAILURE_GRACE_S
            self.update_status()

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._handle_stop_signal)
        signal.signal(signal.SIGINT, self._handle_stop_signal)
        self.emit("launch", pid=os.getpid(), pgid=os.getpgid(0), workers=[s.name for s in self.specs])
        self.status.update(state="starting", pid=os.getpid(), step=0, workers={})
        self.start_workers()
        self.update_status(state="running")
        while any(w.returncode is None for w in self.workers) or any(
                w.state not in ("exited", "failed") for w in self.workers):
            if self.stop_requested and not self.stop_forwarded:
                self.stop_forwarded = True
                self.emit("stop", reason="signal", worker="launcher")
                self.ask_to_stop(self.workers)
            self._check_workers()
            if self.kill_deadline is not None and time.monotonic() > self.kill_deadline:
                self.signal_workers(signal.SIGKILL)
                self.kill_deadline = None
            time.sleep(POLL_INTERVAL_S)
        if self.failure:
            self.update_status(state="failed")
            self.emit("exit", returncode=1, error=self.failure)
            print(f"dflash.train: {self.failure}", file=sys.stderr)
            return 1
        self.update_status(state="stopped")
        self.emit("exit", returncode=0)
        return 0


def launch(cfg: TrainConfig, config_path: str) -> int:
    """Run the multi-process pipeline for `cfg`; the exit status of the run (2: bad layout or input)."""
    try:
        if not Path(cfg.data.path).is_file():
            raise ConfigError("data.path", f"no data file at {cfg.data.path}")
        launcher = Launcher(cfg, config_path)
    except ConfigError as exc:
        print(f"invalid config {config_path}: {exc}", file=sys.stderr)
        return 2
    return launcher.run()
