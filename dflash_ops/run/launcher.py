"""The thin parent of a multi-process run; torchrun (the elastic agent) does the rest.

`run.sh` execs `python -m dflash_ops.train --config <yaml>`; when the config's `pipeline` section asks
for workers, that process becomes this launcher. torchrun spawns the workers
(`python -m dflash_ops.run.pipeline`), runs the c10d rendezvous, sets RANK / LOCAL_RANK / WORLD_SIZE,
restarts the whole group (up to `pipeline.max_restarts` times) when a worker dies, and keeps each
worker's error report (torch.distributed.elastic's per-rank error files). What torchrun does not
give stays here:

- the layout: one worker per drafter GPU then per target GPU (global rank order, `dflash_ops.run.ranks`:
  rank 0 is drafter 0), refused before anything starts when it overlaps or exceeds the visible GPUs;
  the worker of local rank r uses `cuda:r`, and `CUDA_VISIBLE_DEVICES` lists the layout's GPUs in
  rank order. A run across several containers (`pipeline.members`) has one launcher and one
  torchrun per member, joined by a c10d rendezvous at `pipeline.rendezvous` on member 0;
- the log and `status.json`: every worker writes JSON lines to torchrun's stdout, which is this
  process's pipe; they are forwarded to the run's log, and `status.json` follows them and this
  process's own events (`dflash_ops.run.status.RunStatus`, its one writer);
- the stop: torchrun's workers live in sessions of their own, so a SIGTERM to the run's process
  group reaches this process and torchrun only. torchrun ignores it (its handler raises on every
  signal, so a second one would abandon its workers mid-checkpoint); this process sends SIGTERM once
  to each worker, which finishes or abandons its step (drafter 0 checkpoints) and exits 0, and
  torchrun then exits 0 too;
- the cause of a failed start: the first error report a worker wrote (its error file, by the time
  it was written), unless torchrun saw a worker killed by a signal, which can write none; torchrun's
  failure line is the only word of that, and is read for that alone;
- death with the parent: torchrun and every worker get SIGKILL when their parent dies, so a
  SIGKILL to the process group leaves no worker behind in another session.

It imports no torch: it stays small and answers signals at once. The stop path's timeouts:
docs/PIPELINE.md, "Stopping: who waits for what".
"""

from __future__ import annotations

import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dflash_ops.core.compile_cache import compile_cache_environment
from dflash_ops.core.config import ConfigError, PipelineConfig, TrainConfig
from dflash_ops.core.devices import visible_devices
from dflash_ops.core.stopping import PIPES_CLOSE_TIMEOUT_S, TORCHRUN_SHUTDOWN_TIMEOUT_S, die_with_parent
from dflash_ops.data.feature_cache import check_cache
from dflash_ops.run.balance import MeasuredWaits
from dflash_ops.run.metrics import RunMetrics
from dflash_ops.run.ranks import first_rank, rank_table
from dflash_ops.run.status import LAUNCHER, RunStatus, StatusLog

STDERR_TAIL_LINES = 40
POLL_INTERVAL_S = 0.05
MONITOR_INTERVAL_S = 0.2  # how often torchrun looks at its workers
# torchrun's log line for the first failure of a start (torch.distributed.elastic.multiprocessing):
# read only for a worker killed by a signal, of which no error file tells.
_TORCHRUN_FAILURE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


@dataclass(frozen=True)
class WorkerSpec:
    """One worker process of the layout."""

    name: str  # drafter0, drafter1..., target0...
    role: str  # "drafter" | "target"
    role_rank: int  # index among the workers of its role, over every member
    rank: int  # global torch.distributed rank: the member's first rank + LOCAL_RANK
    gpus: tuple[int, ...]  # the layout's GPU indices (into the launcher's visible GPUs); () on CPU


def plan_workers(pipeline: PipelineConfig, n_visible_gpus: int) -> list[WorkerSpec]:
    """This member's workers in local rank order, or ConfigError when the layout names GPUs that are
    not visible here. (PipelineConfig already refused layouts that cannot run anywhere.)"""
    pipeline.check_visible_gpus(n_visible_gpus)
    n_drafters, n_targets = pipeline.local_counts
    gpus = [(g,) for g in pipeline.drafter_gpus + pipeline.target_gpus] or [()] * (n_drafters + n_targets)
    table, first = rank_table(pipeline), first_rank(pipeline)
    return [WorkerSpec(*table[first + local][:3], first + local, gpus[local]) for local in range(len(gpus))]


def rendezvous_arguments(pipeline: PipelineConfig) -> list[str]:
    """One container: c10d on loopback. Several members: c10d at member 0's endpoint, which member 0
    hosts (`is_host`; on a shared loopback every member would think it could), each member known by
    its own address."""
    if not pipeline.members:
        return ["--standalone", "--nnodes", "1"]
    is_host = "true" if pipeline.member == 0 else "false"
    own = ["--local-addr", pipeline.address] if pipeline.address else []
    return ["--nnodes", str(len(pipeline.members)), "--rdzv-backend", "c10d", "--rdzv-id", "dflash",
            "--rdzv-endpoint", pipeline.rendezvous,
            "--rdzv-conf", f"is_host={is_host},join_timeout={pipeline.rendezvous_timeout}", *own]


def torchrun_command(pipeline: PipelineConfig, config_path: str, n_workers: int, log_dir: str,
                     overrides: tuple[str, ...] = ()) -> list[str]:
    """torchrun for this container: the rendezvous, one worker per layout slot, its per-rank error
    files under `log_dir`; each worker reads the config with the command line's `overrides`."""
    return [
        sys.executable, "-m", "torch.distributed.run", *rendezvous_arguments(pipeline),
        "--nproc-per-node", str(n_workers), "--max-restarts", str(pipeline.max_restarts),
        "--monitor-interval", str(MONITOR_INTERVAL_S), "--shutdown-timeout", str(TORCHRUN_SHUTDOWN_TIMEOUT_S),
        # SIGTERM/SIGINT are this launcher's to forward (see the module's docstring).
        "--signals-to-handle", "SIGHUP,SIGQUIT", "--log-dir", log_dir,
        "-m", "dflash_ops.run.pipeline", "--config", config_path, *overrides,
    ]


def torchrun_environment(specs: list[WorkerSpec], pipeline: PipelineConfig, devices: list[str],
                         output_dir: str | None = None) -> dict[str, str]:
    """torchrun's environment (its workers inherit it): the layout's GPUs in rank order (the worker
    of local rank r uses cuda:r), the thread count, loopback for the collectives' sockets, and
    torch.compile's cache under the run's `output_dir` unless set (dflash_ops.core.compile_cache)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    threads = str(pipeline.threads_per_worker)
    env.update({
        # An empty CUDA_VISIBLE_DEVICES hides every GPU from CPU workers.
        "CUDA_VISIBLE_DEVICES": ",".join(devices[spec.gpus[0]] for spec in specs if spec.gpus),
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "PYTHONUNBUFFERED": "1",
    })
    if pipeline.members:
        # Each start of the group rendezvouses in a store of its own (hosted by global rank 0's
        # worker): torchrun's restart counts, which named each start's keys in one container, differ
        # between members (only the member whose worker failed counts a restart).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    else:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env.setdefault(name, "lo")  # one container: the rendezvous and the collectives stay on loopback
    if output_dir is not None:
        env.update(compile_cache_environment(output_dir, env, create=pipeline.device == "cuda"))
    return env


def _torchrun_setup() -> None:
    """In torchrun before exec: SIGTERM and SIGINT ignored (they are the launcher's), nothing it or
    its workers write (the error files) writable by group or others, death with the launcher."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.umask(os.umask(0) | 0o022)
    die_with_parent()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def read_error_report(path: str | None) -> tuple[int, str] | None:
    """(when it was written, in ns, its message) of a worker's torchrun error file, or None when the
    worker wrote none. torchrun's own timestamp in it counts whole seconds; the file's does not."""
    try:
        written = os.stat(path).st_mtime_ns
        message = json.loads(Path(path).read_text())["message"]
    except (TypeError, OSError, ValueError, KeyError):
        return None
    return written, message["message"] if isinstance(message, dict) else str(message)


@dataclass
class Worker:
    """A worker of the current start of the group, as its `worker_start` line announced it."""

    spec: WorkerSpec
    pid: int
    error_file: str | None
    asked_to_stop: bool = False
    returncode: int | None = None  # from its worker_exit line

    def report(self) -> tuple[int, str] | None:
        return read_error_report(self.error_file)

    def __str__(self) -> str:
        return f"worker {self.spec.name} (pid {self.pid})"


class Launcher:
    def __init__(self, cfg: TrainConfig, config_path: str, lock_fd: int | None = None):
        self.cfg = cfg
        self.lock_fd = lock_fd  # the run directory's lock (dflash_ops.run.run_lock): torchrun holds it too
        self.config_path = str(Path(config_path).resolve())
        self.devices = visible_devices() if cfg.pipeline.device == "cuda" else []
        self.specs = plan_workers(cfg.pipeline, len(self.devices))
        self.status = RunStatus(cfg.run.output_dir, metrics=RunMetrics.of(cfg.run, cfg.pipeline.member))
        roles = [s.role for s in self.specs]  # this container's workers: the split it can change
        self.waits = MeasuredWaits(roles.count("target"), roles.count("drafter"))
        self.log = StatusLog(cfg.total_steps, self.status)
        self.lock = threading.RLock()
        self.workers: dict[str, Worker] = {}  # the current start's workers, by name
        self.attempt = 0  # torchrun's restart count
        self.stop_requested = False
        self.stop_forwarded = False
        self.torchrun_failure: tuple[int, int, int] | None = None  # the start's (local rank, pid, exit code)
        self.stderr_tail: collections.deque = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.process: subprocess.Popen | None = None

    # --- the log and status.json -------------------------------------------------------------
    def emit(self, event: str, **fields) -> None:
        with self.lock:
            self.log.emit(event, **fields)

    def _on_line(self, line: str) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        event = isinstance(record, dict) and "event" in record
        with self.lock:
            if event and record["event"] == "worker_start":
                self._on_worker_start(record)  # a restart's event first, then the worker's line
            self.log.write_line(line)  # a full log loses the line, not this reader (the workers would block)
            if event:
                self.status.follow(record)
                self._on_event(record)

    def _on_event(self, record: dict) -> None:
        event, worker = record["event"], self.workers.get(record.get("worker"))
        self.log.note(record)
        self.waits.follow(record)
        if event == "step":
            self.log.show_progress(record["step"], record["loss"], record.get("tokens_per_s") or 0.0,
                                   record.get("samples_per_s"))
            balance = self.waits.advice()
            if balance is not None:  # every log interval: who waits, and the split the waits call for
                self.emit("balance", **balance)
        if worker is None:
            return
        if event == "stop" and worker.spec.role == "drafter":
            # The drafters have checkpointed and stop: the targets must stop feeding them.
            self._ask_to_stop([w for w in self.workers.values() if w.spec.role == "target"])
        elif event == "worker_exit":
            worker.returncode = record.get("returncode")

    def _on_worker_start(self, record: dict) -> None:
        restart = int(record.get("restart", 0))
        if restart > self.attempt:  # torchrun restarted the group
            cause = self.start_failure() or "a worker failed"
            self.attempt, self.workers, self.torchrun_failure = restart, {}, None
            self.emit("restart", restart=restart, max_restarts=self.cfg.pipeline.max_restarts, cause=cause)
        spec = self.specs[int(record["local_rank"])]
        worker = Worker(spec, int(record["pid"]), record.get("error_file"))
        self.workers[spec.name] = worker
        if self.stop_forwarded:  # started after the stop was asked for: it stops at once
            self._ask_to_stop([worker])

    def _on_stderr(self, line: str) -> None:
        with self.lock:
            self.stderr_tail.append(line)
            self.log.write_line(line, stream=sys.stderr)
            match = _TORCHRUN_FAILURE.search(line)
            if match:
                code, local_rank, pid = (int(g) for g in match.groups())
                self.torchrun_failure = (local_rank, pid, code)
                _, worker, _ = self._named_by_torchrun()
                if code < 0 and worker is not None and worker.returncode is None:
                    # Killed by a signal, it could not log its own exit: torchrun's word stands for it.
                    worker.returncode = code
                    self.emit("worker_exit", worker=worker.spec.name, pid=pid, returncode=code)

    def _named_by_torchrun(self) -> tuple[str, Worker | None, int] | None:
        """The worker torchrun's failure line named for this start: what to call it, its `Worker`
        (None if it is not one of this start's), its exit code; None when torchrun named none."""
        if self.torchrun_failure is None:
            return None
        local_rank, pid, code = self.torchrun_failure
        name = self.specs[local_rank].name if local_rank < len(self.specs) else f"local rank {local_rank}"
        worker = self.workers.get(name)
        if worker is not None and worker.pid != pid:
            worker = None
        return f"worker {name} (pid {pid})", worker, code

    def start_failure(self) -> str | None:
        """Why the current start of the group failed, or None when nothing says it did. A worker
        torchrun saw killed by a signal is the cause (it could report nothing; its peers then report
        a lost peer); otherwise the first error report a worker wrote; otherwise the worker torchrun
        saw fail."""
        named = self._named_by_torchrun()
        if named is not None and named[2] < 0:
            who, worker, code = named
            report = worker.report() if worker is not None else None
            return f"{who} was {describe_exit(code)}" + (f": {report[1]}" if report else "")
        reports = sorted((report, str(w)) for w in self.workers.values() if (report := w.report()))
        if reports:
            (_, message), who = reports[0]
            return f"{who} failed: {message}"
        return None if named is None else f"{named[0]} failed with {describe_exit(named[2])}"

    def _pump(self, stream, handle) -> None:
        for raw in stream:
            handle(raw.rstrip("\n"))

    # --- the stop ----------------------------------------------------------------------------
    def _ask_to_stop(self, workers: list[Worker]) -> None:
        """SIGTERM, once, to those of `workers` that have not been asked or exited."""
        for worker in workers:
            if not worker.asked_to_stop and worker.returncode is None:
                worker.asked_to_stop = True
                try:
                    os.kill(worker.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def _handle_stop_signal(self, signum, frame) -> None:
        self.stop_requested = True

    # --- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._handle_stop_signal)
        signal.signal(signal.SIGINT, self._handle_stop_signal)
        log_dir = tempfile.mkdtemp(prefix="dflash-torchrun-")  # torchrun's per-rank error files
        try:
            return self._run(log_dir)
        finally:
            shutil.rmtree(log_dir, ignore_errors=True)

    def _run(self, log_dir: str) -> int:
        command = torchrun_command(self.cfg.pipeline, self.config_path, len(self.specs), log_dir,
                                   self.cfg.overrides)
        self.emit("launch", pid=os.getpid(), pgid=os.getpgid(0), workers=[s.name for s in self.specs],
                  max_restarts=self.cfg.pipeline.max_restarts)
        self.process = subprocess.Popen(
            command, env=torchrun_environment(self.specs, self.cfg.pipeline, self.devices,
                                              self.cfg.run.output_dir),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
            preexec_fn=_torchrun_setup,  # same process group as the launcher: never a new session
            pass_fds=() if self.lock_fd is None else (self.lock_fd,),  # the lock lasts while torchrun lives
        )
        streams = ((self.process.stdout, self._on_line), (self.process.stderr, self._on_stderr))
        pumps = [threading.Thread(target=self._pump, args=pair, daemon=True) for pair in streams]
        for pump in pumps:
            pump.start()
        while self.process.poll() is None:
            if self.stop_requested and not self.stop_forwarded:
                with self.lock:
                    self.stop_forwarded = True
                    self.emit("stop", reason="signal", worker=LAUNCHER)
                    self._ask_to_stop(list(self.workers.values()))
            time.sleep(POLL_INTERVAL_S)
        for pump in pumps:  # the pipes close when torchrun and its workers are gone
            pump.join(timeout=PIPES_CLOSE_TIMEOUT_S)
        return self._finish(self.process.returncode)

    def _finish(self, code: int) -> int:
        clean = len(self.workers) == len(self.specs) and all(w.returncode == 0 for w in self.workers.values())
        if (code == 0 or (self.stop_requested and clean)) and self.status.lost is not None:
            # The drafters ended, but the final checkpoint could not be written: steps no checkpoint holds.
            self.emit("exit", returncode=1, error=self.status.lost, restarts=self.attempt)
            print(f"dflash_ops.train: {self.status.lost}", file=sys.stderr)
            return 1
        if code == 0 or (self.stop_requested and clean):
            self.emit("exit", returncode=0, restarts=self.attempt)
            return 0
        last_line = next((line for line in reversed(self.stderr_tail) if line.strip()), "no error output")
        error = self.start_failure() or f"torchrun failed with {describe_exit(code)}: {last_line}"
        if self.attempt >= self.cfg.pipeline.max_restarts and self.torchrun_failure:
            error += f" (after {self.attempt} restart(s) of {self.cfg.pipeline.max_restarts} allowed)"
        self.emit("error", message=error, stderr_tail="\n".join(self.stderr_tail))
        self.emit("exit", returncode=1, error=error, restarts=self.attempt)
        print(f"dflash_ops.train: {error}", file=sys.stderr)
        return 1


def launch(cfg: TrainConfig, config_path: str, lock_fd: int | None = None) -> int:
    """Run the multi-process pipeline for `cfg`; the exit status of the run (2: bad layout or input).
    `lock_fd`: the run directory's held lock, which torchrun inherits (dflash_ops.run.run_lock)."""
    try:
        if not Path(cfg.data.path).is_file():
            raise ConfigError("data.path", f"no data file at {cfg.data.path}")
        if cfg.data.features_path is not None:  # once per launch: torchrun's restarts do not hash it again
            check_cache(cfg, checksums=cfg.data.features_verify == "checksums")
        launcher = Launcher(cfg, config_path, lock_fd)
    except ConfigError as exc:
        print(f"invalid config {config_path}: {exc}", file=sys.stderr)
        return 2
    return launcher.run()
