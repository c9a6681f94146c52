"""What a run records for people and for plots, besides the JSON-lines log.

- `IntervalMeter` sums the steps since the last log line, so that the logged loss, accuracy,
  gradient norm and throughput are means over the interval, not one step's figure.
- `RunTelemetry` appends every logged interval and every held-out evaluation to
  `<output_dir>/metrics.jsonl` (one JSON object a line, `"kind": "train" | "heldout"`; after a resume
  the steps redone since the last checkpoint appear twice, the later line wins) and writes the same
  scalars as TensorBoard event files under `<output_dir>/tensorboard/`
  (`tensorboard --logdir <output_dir>/tensorboard`). Files are opened on the first record, so a
  process that records nothing (a drafter rank other than 0) leaves nothing behind. Where the
  `tensorboard` package is missing (a container venv without it), `warn` is told once and the run
  goes on with metrics.jsonl alone.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_ops.core.runtime import FILE_MODE, ensure_dir, json_line, output_mode
from dflash_ops.core.safe_paths import open_file

# An annotation only: the controller's plots (dflash_ops.plots) read METRICS_FILE without torch.
if TYPE_CHECKING:
    from dflash_ops.training.trainer import StepResult

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _mean(total: float, count: int) -> float:
    return total / count if count else math.nan


class IntervalMeter:
    """Sums of the steps since the last `flush()`."""

    def __init__(self):
        self._reset()

    def _reset(self) -> None:
        self.steps, self.loss_sum, self.grad_norm_sum, self.grad_norm_max = 0, 0.0, 0.0, 0.0
        self.tokens, self.samples, self.seconds, self.waited = 0, 0, 0.0, 0.0
        self.hits: list[int] = []
        self.counts: list[int] = []

    def add(self, result: StepResult, seconds: float, samples: int = 0, waited: float = 0.0) -> None:
        """One step of `seconds` that trained on `samples` rows (the global batch, every drafter rank's),
        `waited` of them spent waiting for its batch."""
        self.steps += 1
        self.samples += samples
        self.waited += waited
        self.loss_sum += result.loss
        self.grad_norm_sum += result.grad_norm
        self.grad_norm_max = max(self.grad_norm_max, result.grad_norm)
        self.tokens += result.num_tokens
        self.seconds += seconds
        if not self.hits:
            self.hits, self.counts = [0] * len(result.position_hits), [0] * len(result.position_counts)
        self.hits = [a + b for a, b in zip(self.hits, result.position_hits, strict=True)]
        self.counts = [a + b for a, b in zip(self.counts, result.position_counts, strict=True)]

    def flush(self) -> dict:
        """The interval's figures (means over its steps; accuracy over its scored positions), then reset.
        `accuracy_by_position[k-1]` is the accuracy at block position k (1..b-1)."""
        scored = sum(self.counts)
        figures = {
            "loss": _mean(self.loss_sum, self.steps),
            "accuracy": _mean(sum(self.hits), scored),
            "accuracy_by_position": [round(_mean(h, c), 4) for h, c in zip(self.hits[1:], self.counts[1:],
                                                                             strict=True)],
            "grad_norm": _mean(self.grad_norm_sum, self.steps),
            "grad_norm_max": self.grad_norm_max,
            "tokens_per_s": round(self.tokens / self.seconds, 1) if self.seconds > 0 else None,
            "samples_per_s": round(self.samples / self.seconds, 2) if self.seconds > 0 else None,
            # This rank's wait for its batches (the target's features) and its own work, over the interval.
            "wait_fraction": round(self.waited / self.seconds, 4) if self.seconds > 0 else None,
            "busy_s": round(self.seconds - self.waited, 4),
            "interval_steps": self.steps,
        }
        self._reset()
        return figures


def scalars(prefix: str, figures: dict) -> dict[str, float]:
    """TensorBoard tags of a record: numbers as `prefix/name`, lists as `prefix/name/k` (k from 1)."""
    tags = {}
    for name, value in figures.items():
        if isinstance(value, list):
            tags.update({f"{prefix}/{name}/{k}": v for k, v in enumerate(value, start=1) if v is not None})
        elif isinstance(value, int | float) and not isinstance(value, bool):
            tags[f"{prefix}/{name}"] = value
    return tags


class RunTelemetry:
    """metrics.jsonl and TensorBoard event files in a run's output directory."""

    def __init__(self, output_dir: str | Path, enabled: bool = True, warn=None):
        self.output_dir = Path(output_dir)
        self.enabled = enabled
        self.warn = warn or (lambda message: None)
        self._writer = None
        self._tensorboard_missing = False
        self._failing = False  # metrics.jsonl could not be written (a full disk): warned once

    @property
    def writer(self):
        """The TensorBoard writer, or None when the package is missing."""
        if self._writer is None and not self._tensorboard_missing:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                self._tensorboard_missing = True
                self.warn(f"no TensorBoard event files ({exc}); metrics.jsonl has the same figures")
                return None
            self._writer = SummaryWriter(str(ensure_dir(self.output_dir / TENSORBOARD_DIR)))
            # The writer opens its event file with the process's umask; like every file of the run it
            # must not be writable by group or others.
            for event_file in (self.output_dir / TENSORBOARD_DIR).iterdir():
                event_file.chmod(output_mode(FILE_MODE))
        return self._writer

    def record(self, kind: str, step: int, figures: dict) -> None:
        """Append `{"kind", "step", **figures}` to metrics.jsonl and its scalars to TensorBoard."""
        if not self.enabled:
            return
        path = ensure_dir(self.output_dir) / METRICS_FILE
        line = json_line({"kind": kind, "step": step, **figures})
        try:
            with os.fdopen(open_file(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE), "a") as f:
                os.fchmod(f.fileno(), output_mode(FILE_MODE))
                f.write(line + "\n")
        except OSError as exc:  # a full disk costs figures, not the run
            if not self._failing:
                self.warn(f"{path} cannot be written ({exc.strerror or exc}): figures are lost until it can")
            self._failing = True
            return
        self._failing = False
        writer = self.writer
        if writer is None:
            return
        for tag, value in scalars(kind, figures).items():
            writer.add_scalar(tag, value, step)
        writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
