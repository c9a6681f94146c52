"""The run's figures as Prometheus metrics, in a file node_exporter's textfile collector serves.

`RunMetrics` follows the same lines of the run's log as status.json (`RunStatus.follow` hands it each
record with status.json's fields) and rewrites `<textfile_dir>/dflash_<run>_<member>.prom` after each:
written to a temporary file in that directory and renamed over the old one, so a scrape reads either
the previous file or the new one, never half of one. A heartbeat thread reads the GPUs and rewrites it
every `HEARTBEAT_S` seconds between lines (off the step's path), so that
`dflash_run_heartbeat_timestamp_seconds` tells a live run from a dead one, and
`dflash_run_last_step_timestamp_seconds` a stepping run from a stalled one (ages are Prometheus's
`time() - ...`, the textfile idiom: a file holds no clock).

Off unless the config's `run.metrics_textfile_dir` names a directory (docs/OPERATIONS.md, "Metrics and
alerts"). The exposition format (text 0.0.4) is written here rather than through prometheus_client: the
container's venv needs no package for a dozen lines of text, and `promtool check metrics` is the test.

Every series carries the labels `run.metrics_labels` names (the deploy sets container, node and run), and
`member`, the pipeline member this process leads. GPU memory and utilisation come from the container's
`nvidia-smi` (what gpu_verify reads; no NVML binding in the venv, no CUDA context in the launcher), for the
GPUs the run's workers hold, read by the heartbeat; none on CPU or without nvidia-smi.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from dflash_ops.core.devices import visible_devices
from dflash_ops.core.runtime import STATES

HEARTBEAT_S = 15.0
SMI_QUERY = ["nvidia-smi", "--query-gpu=index,uuid,memory.used,utilization.gpu",
             "--format=csv,noheader,nounits"]
PREFIX = "dflash_run_"
_NAME = re.compile(r"[^A-Za-z0-9_.-]")

# name: (type, help)
METRICS = {
    "state": ("gauge", "1 for the run's state (status.json's), 0 for the others."),
    "heartbeat_timestamp_seconds": ("gauge", "When the run's process last wrote this file (Unix time)."),
    "step": ("gauge", "The run's last step."),
    "last_step_timestamp_seconds": ("gauge", "When the run took its last step, or started (Unix time)."),
    "samples_per_second": ("gauge", "Training samples per second over the last logged interval."),
    "tokens_per_second": ("gauge", "Training tokens per second over the last logged interval."),
    "loss": ("gauge", "Training loss, the mean of the last logged interval."),
    "heldout_tau": ("gauge", "Acceptance length tau of the last held-out evaluation."),
    "last_checkpoint_step": ("gauge", "Step of the last complete checkpoint."),
    "last_checkpoint_timestamp_seconds": ("gauge", "When the last checkpoint was saved (Unix time)."),
    "torchrun_restarts_total": ("counter", "Restarts of the worker group by torchrun since the run started."),
    "balance_wait_ratio": ("gauge", "Fraction of its time each role waits for the other (the balance line)."),
    "gpu_memory_used_bytes": ("gauge", "Memory used on each GPU the run holds, all processes (nvidia-smi)."),
    "gpu_utilization_ratio": ("gauge", "Utilisation of each GPU the run holds (nvidia-smi, 0..1)."),
    "output_info": ("gauge", "The run's output directory and the mount point of its file system (value 1)."),
}


def escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def sample(name: str, labels: dict, value: float) -> str:
    inner = ",".join(f'{key}="{escape(val)}"' for key, val in labels.items())
    number = "NaN" if math.isnan(value) else repr(float(value))
    return f"{PREFIX}{name}{{{inner}}} {number}"


def exposition(series: dict[str, list[tuple[dict, float]]]) -> str:
    """The text format of `series` (name -> [(labels, value)]), names in METRICS' order, HELP and TYPE
    once each; a name without samples is left out."""
    lines = []
    for name, (kind, text) in METRICS.items():
        if series.get(name):
            lines += [f"# HELP {PREFIX}{name} {text}", f"# TYPE {PREFIX}{name} {kind}"]
            lines += [sample(name, labels, value) for labels, value in series[name]]
    return "\n".join(lines) + "\n"


def mountpoint_of(path: str | Path) -> str:
    """The mount point of the file system holding `path` (node_exporter's `mountpoint` label)."""
    path = Path(os.path.abspath(path))
    while not os.path.ismount(path):
        path = path.parent
    return str(path)


def parse_smi(text: str, indices, visible: list[str]) -> dict[int, dict[str, float]]:
    """{index: {"memory": bytes, "utilization": 0..1}} of the run's GPU `indices` (into `visible`, the
    launcher's CUDA_VISIBLE_DEVICES entries: nvidia-smi indices or UUIDs) from nvidia-smi's CSV rows
    (index, uuid, memory.used MiB, utilization.gpu %); a GPU whose figures are not numbers is left out."""
    wanted = {visible[i]: i for i in indices if 0 <= i < len(visible)}
    found = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            continue
        index = wanted.get(fields[0], wanted.get(fields[1]))
        try:
            figures = {"memory": float(fields[2]) * 2**20, "utilization": float(fields[3]) / 100.0}
        except ValueError:  # [N/A], [Not Supported]
            continue
        if index is not None:
            found[index] = figures
    return found


def smi_gpus(indices) -> dict[int, dict[str, float]]:
    """The run's GPUs as nvidia-smi reports them now; {} where it does not answer (no driver, a CPU run)."""
    try:
        out = subprocess.run(SMI_QUERY, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_smi(out.stdout, indices, visible_devices()) if out.returncode == 0 else {}


class RunMetrics:
    """The run's .prom file in `textfile_dir`; `gpus(indices)` reads the GPUs (smi_gpus, or a stand-in)."""

    def __init__(self, textfile_dir: str | Path, labels: dict, member: int = 0, output_dir: str | None = None,
                 gpus=smi_gpus, heartbeat_s: float = HEARTBEAT_S):
        self.dir = Path(textfile_dir)
        self.output = ({"output_dir": output_dir, "mountpoint": mountpoint_of(output_dir)} if output_dir
                       else None)
        self.labels = {**{k: str(v) for k, v in labels.items()}, "member": str(member)}
        name = _NAME.sub("_", f"dflash_{self.labels.get('run', 'run')}_{member}")
        self.path = self.dir / f"{name}.prom"
        self.read_gpus = gpus
        self.gpus: dict[int, dict[str, float]] = {}  # the heartbeat's last read
        self.fields: dict = {}
        self.last_step_time = time.time()  # the run's start stands for its last step until it takes one
        self.samples_per_s: float | None = None
        self.checkpoint_step: int | None = None
        self.checkpoint_time: float | None = None  # unknown for a resumed run's checkpoint until it saves one
        self.write_failed = False
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.heartbeat_s = heartbeat_s
        self.thread: threading.Thread | None = None

    @classmethod
    def of(cls, run_cfg, member: int = 0) -> RunMetrics | None:
        """The metrics a run config asks for (`run.metrics_textfile_dir`), or None when off."""
        if not run_cfg.metrics_textfile_dir:
            return None
        labels = dict(run_cfg.metrics_labels) or {"run": Path(run_cfg.output_dir).name}
        return cls(run_cfg.metrics_textfile_dir, labels, member, output_dir=run_cfg.output_dir)

    def follow(self, record: dict, fields: dict) -> None:
        """One line of the log, with status.json's `fields` after it: rewrite the file."""
        event = record.get("event")
        when = record.get("time") or time.time()
        with self.lock:
            if event == "step":
                self.last_step_time = when
                self.samples_per_s = record.get("samples_per_s")
            elif event in ("checkpoint", "resume"):
                self.checkpoint_step = record.get("step")
                self.checkpoint_time = when if event == "checkpoint" else self.checkpoint_time
            self.fields = dict(fields)
        self.write()
        if self.thread is None:
            self.thread = threading.Thread(target=self._heartbeat, name="metrics-heartbeat", daemon=True)
            self.thread.start()

    def _held(self) -> list[int]:
        return sorted({g for w in (self.fields.get("workers") or {}).values() for g in w.get("gpus") or []})

    def beat(self) -> None:
        """Read the GPUs the run holds (a process of nvidia-smi, never on the caller of `follow`), then
        rewrite the file."""
        held = self._held()
        gpus = self.read_gpus(held) if held else {}
        with self.lock:
            self.gpus = gpus
        self.write()

    def _heartbeat(self) -> None:
        while self.fields.get("state") not in ("stopped", "failed"):  # an ended run's last file stays
            self.beat()
            if self.stopped.wait(self.heartbeat_s):
                return

    def close(self) -> None:
        self.stopped.set()

    def series(self) -> dict[str, list[tuple[dict, float]]]:
        f, base = self.fields, self.labels
        out: dict[str, list[tuple[dict, float]]] = {
            "state": [({**base, "state": s}, float(f.get("state") == s)) for s in STATES],
            "heartbeat_timestamp_seconds": [(base, time.time())],
            "last_step_timestamp_seconds": [(base, self.last_step_time)],
            "torchrun_restarts_total": [(base, f.get("restarts") or 0)],
        }
        figures = {"step": f.get("step"), "samples_per_second": self.samples_per_s,
                   "tokens_per_second": f.get("tokens_per_s"), "loss": f.get("loss"),
                   "heldout_tau": f.get("heldout_tau"),
                   "last_checkpoint_step": self.checkpoint_step,
                   "last_checkpoint_timestamp_seconds": self.checkpoint_time}
        out.update({name: [(base, value)] for name, value in figures.items() if value is not None})
        balance = f.get("balance") or {}
        waits = {role: balance.get(f"{role}_wait") for role in ("target", "drafter")}
        out["balance_wait_ratio"] = [({**base, "role": r}, w) for r, w in waits.items() if w is not None]
        held = self._held()
        gpus = {i: g for i, g in self.gpus.items() if i in held}
        out["gpu_memory_used_bytes"] = [({**base, "gpu": str(i)}, g["memory"]) for i, g in gpus.items()]
        out["gpu_utilization_ratio"] = [({**base, "gpu": str(i)}, g["utilization"]) for i, g in gpus.items()]
        out["output_info"] = [({**base, **self.output}, 1.0)] if self.output else []
        return out

    def write(self) -> None:
        """Write the file atomically: a temporary file beside it, renamed over it. A directory that cannot
        be written costs the metrics, never the run: stderr (the run's log) says so once."""
        with self.lock:
            text = exposition(self.series())
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")  # node_exporter reads *.prom
            try:
                tmp.write_text(text)
                os.chmod(tmp, 0o644)
                os.replace(tmp, self.path)
            except OSError as err:
                if not self.write_failed:
                    print(f"metrics: cannot write {self.path} ({err}); the run goes on without them",
                          file=sys.stderr, flush=True)
                self.write_failed = True
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:
                    pass
                return
            self.write_failed = False
