"""The thin parent of a multi-process run; torchrun (the elastic agent) does the rest.

`run.sh` execs `python -m dflash.train --config <yaml>`; when the config's `pipeline` section asks
for workers, that process becomes this launcher. torchrun spawns the workers
(`python -m dflash.pipeline`), runs the c10d rendezvous, sets RANK / LOCAL_RANK / WORLD_SIZE and
restarts the whole group (up to `pipeline.max_restarts` times) when a worker dies. What torchrun
does not give stays here:

- the layout: one worker per drafter GPU then per target GPU (global rank order, so rank 0 is
  drafter 0), refused before anything starts when it overlaps or exceeds the visible GPUs; the
  worker of local rank r uses `cuda:r`, and `CUDA_VISIBLE_DEVICES` lists the layout's GPUs in rank
  order. A run across several containers (`pipeline.members`) has one launcher and one torchrun
  per member, joined by a c10d rendezvous at `pipeline.rendezvous` on member 0; global ranks go
  member by member in member order, each member's drafters then its targets (`rank_table`);
- the log and `status.json`: every worker writes JSON lines to torchrun's stdout, which is this
  process's pipe; they are forwarded to the run's log, and `status.json` (step, loss, last
  checkpoint, restarts, the error, per-worker state) follows them;
- the stop: torchrun's workers live in sessions of their own, so a SIGTERM to the run's process
  group reaches this process and torchrun only. torchrun ignores it (it would raise and abandon
  its workers on a second one); this process sends SIGTERM once to each worker, which finishes or
  abandons its step (drafter 0 checkpoints) and exits 0, and torchrun then exits 0 too;
- death with the parent: torchrun and every worker get SIGKILL when their parent dies, so a
  SIGKILL to the process group leaves no worker behind in another session.

It imports no torch: it stays small and answers signals at once.
"""

from __future__ import annotations

import collections
import ctypes
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash.config import ConfigError, PipelineConfig, TrainConfig
from dflash.devices import visible_devices
from dflash.runtime import EventLog, StatusFile

# Seconds the workers get to exit after torchrun's SIGTERM (a failed worker, a finished run),
# before torchrun's SIGKILL.
FAILURE_GRACE_S = float(os.environ.get("DFLASH_FAILURE_GRACE_S", "10"))
STDERR_TAIL_LINES = 40
POLL_INTERVAL_S = 0.05
MONITOR_INTERVAL_S = 0.2  # how often torchrun looks at its workers
_PR_SET_PDEATHSIG = 1
# torchrun's log line for a worker that ended with an error (torch.distributed.elastic.multiprocessing).
_TORCHRUN_FAILURE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


@dataclass(frozen=True)
class WorkerSpec:
    """One worker process of the layout."""

    name: str  # drafter0, drafter1..., target0...
    role: str  # "drafter" | "target"
    role_rank: int  # index among the workers of its role, over every member
    rank: int  # global torch.distributed rank: the member's first rank + LOCAL_RANK (`rank_table`)
    gpus: tuple[int, ...]  # the layout's GPU indices (into the launcher's visible GPUs); () on CPU


def rank_table(pipeline: PipelineConfig) -> list[tuple[str, str, int, int]]:
    """(name, role, role rank, member) of every global rank of the run, in rank order: member by
    member in member order, and within a member its drafters, then its targets; role ranks count in
    rank order. One member: drafters first, rank 0 is drafter 0. Members [1+1, 1+1]: drafter0,
    target0 (member 0), drafter1, target1 (member 1)."""
    table: list[tuple[str, str, int, int]] = []
    counts = {"drafter": 0, "target": 0}
    for member, (drafters, targets) in enumerate(pipeline.member_counts):
        for role in ["drafter"] * drafters + ["target"] * targets:
            table.append((f"{role}{counts[role]}", role, counts[role], member))
            counts[role] += 1
    return table


def first_rank(pipeline: PipelineConfig) -> int:
    """The global rank of this member's local rank 0."""
    return sum(d + t for d, t in pipeline.member_counts[:pipeline.member])


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


def torchrun_command(pipeline: PipelineConfig, config_path: str, n_workers: int) -> list[str]:
    """torchrun for this container: the rendezvous, one worker per layout slot."""
    return [
        sys.executable, "-m", "torch.distributed.run", *rendezvous_arguments(pipeline),
        "--nproc-per-node", str(n_workers), "--max-restarts", str(pipeline.max_restarts),
        "--monitor-interval", str(MONITOR_INTERVAL_S), "--shutdown-timeout", str(math.ceil(FAILURE_GRACE_S)),
        # SIGTERM/SIGINT are this launcher's to forward (see the module's docstring).
        "--signals-to-handle", "SIGHUP,SIGQUIT",
        "-m", "dflash.pipeline", "--config", config_path,
    ]


def torchrun_environment(specs: list[WorkerSpec], pipeline: PipelineConfig,
                         devices: list[str]) -> dict[str, str]:
    """torchrun's environment (its workers inherit it): the layout's GPUs in rank order (the worker
    of local rank r uses cuda:r), the thread count, loopback for the collectives' sockets."""
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
    return env


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux PR_SET_PDEATHSIG)."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _torchrun_setup() -> None:
    """In torchrun before exec: SIGTERM and SIGINT ignored (they are the launcher's), death with
    the launcher."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


@dataclass
class WorkerState:
    spec: WorkerSpec
    pid: int
    state: str = "starting"
    error: str | None = None


@dataclass
class Launcher:
    cfg: TrainConfig
    config_path: str
    devices: list[str] = field(default_factory=list)
    specs: list[WorkerSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.config_path = str(Path(self.config_path).resolve())
        if self.cfg.pipeline.device == "cuda":
            self.devices = visible_devices()
        self.specs = plan_workers(self.cfg.pipeline, len(self.devices))
        self.status = StatusFile(self.cfg.run.output_dir)
        self.lock = threading.RLock()
        self.log = EventLog(self.cfg.optim.total_steps,
                            on_log_error=lambda error: self.update_status(log_error=error))
        self.workers: dict[str, WorkerState] = {}  # the current attempt's workers, by name
        self.attempt = 0  # torchrun's restart count
        self.stop_requested = False
        self.stop_forwarded = False
        self.stop_reason = "completed"  # what the drafters said when they stopped (status.json's stop_reason)
        self.last_failure: str | None = None
        # The attempt's first worker to report an error of its own: the cause when the others then fail
        # (a lost peer). torchrun names the earliest failure it sees, by a timestamp in whole seconds,
        # so of workers that ended in one second it names the lowest local rank, not the first.
        self.first_error: WorkerState | None = None
        self.stderr_tail: collections.deque = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.process: subprocess.Popen | None = None

    # --- the log and status.json -------------------------------------------------------------
    def emit(self, event: str, **fields) -> None:
        with self.lock:
            self.log.emit(event, **fields)

    def update_status(self, **fields) -> None:
        with self.lock:
            table = {name: {"state": w.state, "pid": w.pid, "gpus": list(w.spec.gpus)}
                     for name, w in sorted(self.workers.items())}
            self.status.update(workers=table, **fields)

    def _on_line(self, line: str) -> None:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        with self.lock:
            self.log.write_line(line)  # a full log loses the line, not this reader (the workers would block)
            if isinstance(record, dict) and "event" in record:
                self._on_event(record)

    def _on_event(self, record: dict) -> None:
        event, name = record["event"], record.get("worker")
        if event == "worker_start":
            self._on_worker_start(record)
            return
        worker = self.workers.get(name)
        if event == "start" and worker is not None:
            worker.state = "stopping" if self.stop_forwarded else "running"
            self.update_status()
        elif event == "step":
            self.update_status(state="stopping" if self.stop_forwarded else "running",
                               **{k: record.get(k) for k in ("step", "loss", "accuracy", "tokens_per_s")})
            self.log.show_progress(record["step"], record["loss"], record.get("tokens_per_s") or 0.0)
        elif event == "heldout":
            self.update_status(heldout_loss=record.get("heldout_loss"), heldout_tau=record.get("heldout_tau"))
        elif event in ("checkpoint", "resume"):
            path = record.get("path") or record.get("checkpoint")
            self.update_status(step=record.get("step"), last_checkpoint=path,
                               **({"checkpoint_error": None} if event == "checkpoint" else {}))
        elif event == "checkpoint_failed":
            self.update_status(checkpoint_error=record.get("message"))
        elif event == "error" and worker is not None:
            worker.error = record.get("message")
            self.first_error = self.first_error or worker
        elif event == "stop" and worker is not None:
            worker.state = "stopped"
            if worker.spec.role == "drafter":
                self.stop_reason = record.get("reason") or self.stop_reason
            self.update_status()
            if worker.spec.role == "drafter":
                # The drafters have checkpointed and stop: the targets must stop feeding them.
                self._ask_to_stop([w for w in self.workers.values() if w.spec.role == "target"])
        elif event == "worker_exit" and worker is not None:
            worker.state = "exited" if record.get("returncode") == 0 else "failed"
            self.update_status()

    def _on_worker_start(self, record: dict) -> None:
        restart = int(record.get("restart", 0))
        if restart > self.attempt:  # torchrun restarted the group
            self.attempt = restart
            self.workers = {}
            self.first_error = None
            cause = self.last_failure or "a worker failed"
            self.emit("restart", restart=restart, max_restarts=self.cfg.pipeline.max_restarts, cause=cause)
            self.update_status(state="stopping" if self.stop_requested else "starting", restarts=restart)
        spec = self.specs[int(record["local_rank"])]
        worker = WorkerState(spec, int(record["pid"]))
        self.workers[spec.name] = worker
        self.update_status()
        if self.stop_forwarded:  # started after the stop was asked for: it stops at once
            self._ask_to_stop([worker])

    def _on_stderr(self, line: str) -> None:
        with self.lock:
            self.stderr_tail.append(line)
            self.log.write_line(line, stream=sys.stderr)
            match = _TORCHRUN_FAILURE.search(line)
            if match:
                code, local_rank, pid = (int(g) for g in match.groups())
                spec = self.specs[local_rank] if local_rank < len(self.specs) else None
                name = spec.name if spec else f"local rank {local_rank}"
                worker = self.workers.get(name)
                if worker is not None and worker.pid == pid:
                    worker.state = "failed"
                detail = worker.error if worker is not None and worker.error else None
                how = f"was {describe_exit(code)}" if code < 0 else f"failed with {describe_exit(code)}"
                # A worker killed by a signal reports nothing itself: torchrun's word is all there is.
                reported = self._first_reported_error(unless=worker) if code > 0 else None
                self.last_failure = reported or (
                    f"worker {name} (pid {pid}) {how}" + (f": {detail}" if detail else ""))
                self.update_status()

    def _first_reported_error(self, unless=None) -> str | None:
        """The error the attempt's first failing worker reported itself (None if none did, or if it is
        `unless`, the worker torchrun names, whose own report is then used)."""
        cause = self.first_error
        if cause is None or cause is unless:
            return None
        return f"worker {cause.spec.name} (pid {cause.pid}) failed: {cause.error}"

    def _pump(self, stream, handle) -> None:
        for raw in stream:
            handle(raw.rstrip("\n"))

    # --- the stop ----------------------------------------------------------------------------
    def _ask_to_stop(self, workers: list[WorkerState]) -> None:
        """SIGTERM, once, to those of `workers` that have not begun to stop."""
        for worker in workers:
            if worker.state in ("starting", "running"):
                worker.state = "stopping"
                try:
                    os.kill(worker.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        self.update_status()

    def _handle_stop_signal(self, signum, frame) -> None:
        self.stop_requested = True

    # --- lifecycle ---------------------------------------------------------------------------
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._handle_stop_signal)
        signal.signal(signal.SIGINT, self._handle_stop_signal)
        command = torchrun_command(self.cfg.pipeline, self.config_path, len(self.specs))
        self.emit("launch", pid=os.getpid(), pgid=os.getpgid(0), workers=[s.name for s in self.specs],
                  max_restarts=self.cfg.pipeline.max_restarts)
        self.status.update(state="starting", pid=os.getpid(), step=0, workers={})
        self.process = subprocess.Popen(
            command, env=torchrun_environment(self.specs, self.cfg.pipeline, self.devices),
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
            preexec_fn=_torchrun_setup,  # same process group as the launcher: never a new session
        )
        streams = ((self.process.stdout, self._on_line), (self.process.stderr, self._on_stderr))
        pumps = [threading.Thread(target=self._pump, args=pair, daemon=True) for pair in streams]
        for pump in pumps:
            pump.start()
        while self.process.poll() is None:
            if self.stop_requested and not self.stop_forwarded:
                with self.lock:
                    self.stop_forwarded = True
                    self.emit("stop", reason="signal", worker="launcher")
                    self.update_status(state="stopping")
                    self._ask_to_stop(list(self.workers.values()))
            time.sleep(POLL_INTERVAL_S)
        for pump in pumps:  # the pipes close when torchrun and its workers are gone
            pump.join(timeout=10)
        return self._finish(self.process.returncode)

    def _finish(self, code: int) -> int:
        exited = [w for w in self.workers.values() if w.state == "exited"]
        clean = len(exited) == len(self.specs)
        if code == 0 or (self.stop_requested and clean):
            self.update_status(state="stopped", stop_reason="signal SIGTERM" if self.stop_requested
                               else self.stop_reason)
            self.emit("exit", returncode=0, restarts=self.attempt)
            return 0
        last_line = next((line for line in reversed(self.stderr_tail) if line.strip()), "no error output")
        error = (self.last_failure or self._first_reported_error()
                 or f"torchrun failed with {describe_exit(code)}: {last_line}")
        if self.attempt >= self.cfg.pipeline.max_restarts and self.last_failure:
            error += f" (after {self.attempt} restart(s) of {self.cfg.pipeline.max_restarts} allowed)"
        self.emit("error", message=error, stderr_tail="\n".join(self.stderr_tail))
        self.update_status(state="failed", error=error)
        self.emit("exit", returncode=1, error=error, restarts=self.attempt)
        print(f"dflash.train: {error}", file=sys.stderr)
        return 1


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
