"""What a running trainer shows the outside: status.json, JSON log lines, and the stop signal.

- `StatusFile` rewrites `<output_dir>/status.json` atomically (temp file + rename).
- `EventLog` prints one JSON object a line to stdout (`"event"`: start, step, checkpoint, resume,
  stop, error) and, on a TTY, a progress bar on stderr.
- `StopSignal` turns SIGTERM and SIGINT into a flag the loop polls between steps; a second signal
  while the checkpoint is being written only sets the flag again, so it cannot corrupt the save.
- `exit_code_of`: how an entry point's work ends as its exit code (0 done or stopped, 1 crashed, 2 bad
  input), the same for `python -m dflash_ops.train` and `python -m dflash_ops.capture`.
- `ensure_dir` and `output_mode`: whatever the umask the run was started with, nothing it writes
  (status, metrics, checkpoints, exports) is writable by group or other users, nor readable by other
  users (dirs 0750, files 0640, less what a stricter umask removes): the trained weights are the run's
  user's and its group's. With `DFLASH_OUTPUT_GROUP` (the dflash_run role's dflash_run_output_group,
  through training_run's output_group) they are shared with that group: each directory ensure_dir makes
  or is given is that group's, readable by it and setgid (what is made in it inherits the group), and
  its files are readable by it whatever the umask. Nothing is written through a symbolic link or in
  another user's directory (`dflash_ops.core.safe_paths`).
"""

from __future__ import annotations

import grp
import json
import math
import os
import signal
import stat
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from dflash_ops.core.safe_paths import check_directory, open_file

EXIT_OK, EXIT_CRASH, EXIT_BAD_INPUT = 0, 1, 2
STATES = ("starting", "running", "stopping", "stopped", "failed")
DIR_MODE, FILE_MODE = 0o750, 0o640
# What a run's readers that are not its own need to enter and read (a feature cache the run's user reads).
SHARED_DIR_MODE = 0o755
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
# The group a run's outputs are shared with (a name or a gid); unset: none, only the owner's group.
OUTPUT_GROUP_ENV = "DFLASH_OUTPUT_GROUP"


def process_umask() -> int:
    """The umask of this process, read without changing it (os.umask would, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def output_group() -> int | None:
    """The gid of DFLASH_OUTPUT_GROUP (a group name or a gid), or None when it is unset."""
    name = os.environ.get(OUTPUT_GROUP_ENV, "").strip()
    if not name:
        return None
    if name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ValueError(f"{OUTPUT_GROUP_ENV}={name}: no such group (dflash_run_output_group names a group "
                         "of the container)") from None


def output_mode(mode: int) -> int:
    """`mode` less what the umask removes, never writable by group or others; with an output group, the
    group's read (and search) bits of `mode` whatever the umask."""
    shared = mode & 0o050 if output_group() is not None else 0
    return (mode & ~(process_umask() | _OTHERS_WRITE)) | shared


def _share(directory: Path, gid: int | None) -> None:
    """Make `directory` the output group's (readable by it, setgid so that what is made in it is the
    group's too), or leave it to its owner's group when there is none."""
    if gid is None:
        return
    try:
        os.chown(directory, -1, gid, follow_symlinks=False)
    except PermissionError:
        raise PermissionError(f"{directory}: cannot give it to group {gid} ({OUTPUT_GROUP_ENV}): the run's "
                              "user must be a member of dflash_run_output_group") from None
    os.chmod(directory, stat.S_IMODE(os.lstat(directory).st_mode) | 0o050 | stat.S_ISGID)


def ensure_dir(path: str | Path, mode: int = DIR_MODE) -> Path:
    """Create `path` (`mode`, DIR_MODE by default, less the umask; the output group's when there is one)
    and its missing parents (SHARED_DIR_MODE less the umask). An existing `path` loses group and other
    write permission and what `mode` does not give other users: a run's output directory made
    world-writable or world-readable by hand, by an earlier release or by a umask of 000 does not stay so.
    One that is a symbolic link or another user's raises UnsafePath."""
    path = Path(path)
    gid = output_group()
    missing = []
    parent = path
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    for directory in reversed(missing):
        # The parents hold other runs' directories too (/var/lib/dflash/runs): passable by the run's user
        # and the output group; `path` and the files in it are what keep the run's outputs to themselves.
        try:
            os.mkdir(directory, output_mode(mode if directory == path else SHARED_DIR_MODE))
        except FileExistsError:
            continue
        if directory == path:
            _share(directory, gid)
    info = check_directory(path).stat()  # never through a symbolic link, never another user's
    strip = _OTHERS_WRITE | (0o007 & ~mode)
    if info.st_mode & strip:
        os.chmod(path, stat.S_IMODE(info.st_mode) & ~strip)
    if gid is not None and (info.st_gid != gid or not info.st_mode & stat.S_ISGID):
        _share(path, gid)
    elif gid is None and info.st_mode & stat.S_ISGID and info.st_gid != os.getegid():
        # an output group no longer named: its members enter no more (what is in it is reached through it)
        os.chown(path, -1, os.getegid(), follow_symlinks=False)
        os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) & ~(stat.S_ISGID | 0o027))
    return path


def write_file(path: str | Path, text: str) -> None:
    """Write `text` to `path` with FILE_MODE less the umask, even when the file existed before."""
    fd = open_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), output_mode(FILE_MODE))
        f.write(text)


def readable(path: str | Path) -> str:
    """`path` as a string, once it opens for reading. safetensors reports any failure to open a file (a
    permission denied too) as "No such file or directory", so the file is opened here first and the
    system's own error, with its errno, is the one raised."""
    with open(path, "rb"):
        pass
    return str(path)


def finite(value):
    """`value` with every NaN and infinity in it (in lists and mappings too) as None: JSON has neither."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def json_line(record: dict) -> str:
    """`record` as one line of strict JSON (no NaN, no Infinity: `finite`)."""
    return json.dumps(finite(record), allow_nan=False)


class StatusFile:
    def __init__(self, output_dir: str | Path, workers: dict | None = None):
        self.path = ensure_dir(output_dir) / "status.json"
        self.fields = {"state": "starting", "step": 0, "loss": None, "accuracy": None, "tokens_per_s": None,
                       "heldout_loss": None, "heldout_tau": None, "last_checkpoint": None,
                       "pid": os.getpid(), "restarts": 0, "error": None, "workers": workers or {},
                       "checkpoint_error": None, "log_error": None, "stop_reason": None,
                       "balance": None}

    def update(self, **fields) -> None:
        unknown = set(fields) - set(self.fields)
        if unknown:
            raise KeyError(f"status.json has no field(s) {sorted(unknown)}")
        if "state" in fields and fields["state"] not in STATES:
            raise ValueError(f"status state must be one of {STATES}, got {fields['state']!r}")
        self.fields.update({k: finite(v) for k, v in fields.items()})
        record = {**self.fields, "updated_at": datetime.now(UTC).isoformat(timespec="seconds")}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        write_file(tmp, json.dumps(record, indent=2) + "\n")
        os.replace(tmp, self.path)


class EventLog:
    """JSON lines on `stream` (the run's log). A log that cannot be written (its disk is full) costs
    lines, never the run: `on_log_error(message)` hears of the first lost line, `on_log_error(None)`
    once lines get through again, and a `log_resumed` line then says how many were lost."""

    def __init__(self, total_steps: int, stream=None, progress_stream=None, on_log_error=None):
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        progress = progress_stream or sys.stderr
        self.progress = progress if progress.isatty() else None
        self._first_shown: tuple[int, float] | None = None
        self.on_log_error = on_log_error or (lambda message: None)
        self.lost_lines = 0
        self.heldout_tau: float | None = None  # the latest held-out tau logged, for the progress line

    def emit(self, event: str, **fields) -> None:
        record = {"event": event, "time": round(time.time(), 3), **fields}
        self.note(record)
        if self.progress is not None and event != "step":
            self.progress.write("\n")
        self.write_line(json_line(record))

    def note(self, record: dict) -> None:
        """Keep what the progress line shows of a record of the log (its latest held-out tau)."""
        if record.get("event") == "heldout" and finite(record.get("heldout_tau")) is not None:
            self.heldout_tau = record["heldout_tau"]

    def write_line(self, line: str, stream=None) -> None:
        """Write `line` at once; a failed write (ENOSPC, EIO) loses the line, and is reported. A file goes
        straight to its descriptor: a buffer would keep the lost lines and write them out of turn later."""
        stream = stream or self.stream
        if self.lost_lines:  # the newline ends a line the full disk cut short
            line = "\n" + json.dumps({"event": "log_resumed", "time": round(time.time(), 3),
                                      "lost_lines": self.lost_lines}) + "\n" + line
        try:
            try:
                fd = stream.fileno()
            except (AttributeError, OSError, ValueError):  # not a file (a test's buffer)
                fd = None
            if fd is None:
                stream.write(line + "\n")
                stream.flush()
            else:
                stream.flush()  # what print() left in the buffer goes first
                data = (line + "\n").encode()
                while data:
                    data = data[os.write(fd, data):]
        except OSError as exc:
            self.lost_lines += 1
            if self.lost_lines == 1:
                stamp = datetime.now(UTC).isoformat(timespec="seconds")
                self.on_log_error(f"the log cannot be written since {stamp} ({exc.strerror or exc}): its "
                                  f"lines are lost until it can, and training goes on")
            return
        if self.lost_lines:
            self.lost_lines = 0
            self.on_log_error(None)

    def show_progress(self, step: int, loss: float, tokens_per_s: float, samples_per_s: float | None = None
                      ) -> None:
        """`[####....] step/total loss tau samples/s tok/s ETA` on a terminal (tau: the latest held-out
        one this log has carried, once there is one); the ETA extrapolates the pace of the steps shown
        since the first call (so a resumed run's earlier steps do not count)."""
        if self.progress is None:
            return
        now = time.monotonic()
        if self._first_shown is None:
            self._first_shown = (step, now)
        first_step, first_time = self._first_shown
        eta = "--"
        if step > first_step:
            seconds = (self.total_steps - step) * (now - first_time) / (step - first_step)
            eta = format_duration(seconds)
        width = 30
        done = int(width * step / max(1, self.total_steps))
        tau = "" if self.heldout_tau is None else f" tau {self.heldout_tau:.2f}"
        samples = "" if samples_per_s is None else f" {samples_per_s:,.1f} samples/s"
        self.progress.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{self.total_steps} "
                            f"loss {loss:.4f}{tau}{samples} {tokens_per_s:,.0f} tok/s ETA {eta}   ")
        self.progress.flush()


def format_duration(seconds: float) -> str:
    """`1h02m`, `3m05s` or `42s`."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class StopSignal:
    """A flag set by SIGTERM/SIGINT; install() in the main thread, restore() when done."""

    def __init__(self):
        self.event = threading.Event()
        self.signal_name: str | None = None
        # When the first signal came (epoch seconds): the run's stop line says it, so that the time from
        # the stop request to the exit is the run's own (a restart's GPU idle window starts there).
        self.signalled_at: float | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            self.signalled_at = time.time()
        self.event.set()

    def install(self) -> StopSignal:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    def sleep(self, seconds: float) -> None:
        """Sleep, but wake as soon as a stop is requested."""
        if seconds > 0:
            self.event.wait(seconds)


def exit_code_of(work: Callable[[], None], log: EventLog, stop: StopSignal,
                 bad_input: tuple[type[Exception], ...], prog: str) -> int:
    """Run `work` and say how it ended: EXIT_OK; EXIT_BAD_INPUT for one of `bad_input` (an `error`
    event with its message, `prog: message` on stderr, no traceback); EXIT_CRASH for anything else (an
    `error` event naming its type, the traceback on stderr). The stop handler is restored either way."""
    try:
        work()
        return EXIT_OK
    except bad_input as exc:
        log.emit("error", message=str(exc))
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as exc:
        log.emit("error", message=f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        return EXIT_CRASH
    finally:
        stop.restore()
