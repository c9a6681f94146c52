"""Stops at any moment never lose the saved step: SIGTERM and SIGKILL against the trainer.

One output directory lives through a chain of runs of `python -m dflash_ops.train` (each started in
its own session, as `training_run` starts it, under a umask of 000). Each run is ended by one fault:
SIGTERM or SIGKILL at a random time in training, or SIGTERM or SIGKILL while a checkpoint is being
written, at one of the points of the write (see checkpoint_support.POINTS; the full count covers
every kind at every point). After each: the checkpoint the trainer would pick is complete and loadable, and it
is the one the fault allows (SIGTERM: the last step logged; a crash: the newest save that reached
its rename); a temp dir left by a crash is ignored, then removed by the next run; the next run
resumes there and logs saved step + 1 as its first step; nothing in the output directory is
writable by group or other users.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dflash_ops.data.target import load_target
from dflash_ops.training.checkpoint import CHECKPOINT_DIR, CHECKPOINT_FILES, latest_checkpoint, load_drafter
from pvesim.fleet import REPO, prepare_assets
from tests.reliability.checkpoint_support import BEFORE_RENAME, POINTS
from tests.reliability.trial_counts import trials
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

SUPPORT = Path(__file__).with_name("checkpoint_support.py")
SAVE_EVERY = 3
STEP_DELAY = 0.05
# Generous: two runs of tests may share the machine's two cores.
EVENT_TIMEOUT_S = 120


def write_config(tmp_path: Path, name: str, **run) -> Path:
    assets = prepare_assets()
    raw = yaml.safe_load((assets / "config.yaml").read_text())
    raw["data"].update(batch_size=4, max_anchors=16)
    raw["optim"].update(total_steps=100_000)
    raw["run"].update(output_dir=str(tmp_path / "run"), save_every=SAVE_EVERY, keep_checkpoints=2,
                      log_every=1, step_delay=STEP_DELAY, **run)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


class Trainer:
    """One run in its own session under umask 000; its stdout (the run's log) goes to a file."""

    def __init__(self, config: Path, log: Path, *hook_args: str):
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, str(SUPPORT), *hook_args, "--config", str(config)], cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log.open("w"), stderr=subprocess.STDOUT,
            start_new_session=True, umask=0,
        )

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()
                if line.startswith("{") and line.endswith("}")]

    def wait_for(self, predicate, what: str, timeout: float = EVENT_TIMEOUT_S):
        exited = object()
        found = wait_for(lambda: predicate() or (self.proc.poll() is not None and exited),
                         timeout, interval=0.01)
        if found and found is not exited:
            return found
        self.kill()
        pytest.fail(f"no {what} (exit {self.proc.poll()}); log:\n{self.log.read_text()[-3000:]}")

    def first(self, event: str) -> dict:
        return self.wait_for(lambda: next((e for e in self.events() if e["event"] == event), None),
                             f"{event} event")

    def signal(self, signum: int) -> None:
        os.killpg(self.proc.pid, signum)

    def wait(self) -> int:
        return self.proc.wait(timeout=EVENT_TIMEOUT_S)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def steps_of(events: list[dict], kind: str) -> list[int]:
    return [e["step"] for e in events if e["event"] == kind]


def schedule(n: int, rng: random.Random) -> list[tuple[str, str | None]]:
    """The fault of each trial: one of each kind first (points drawn at random), then every kind at
    every point of a save, in shuffled rounds, so that a full run covers each at least once."""
    first = [("sigterm-random", None), ("sigterm-in-save", rng.choice(POINTS)),
             ("sigkill-in-save", rng.choice(POINTS)), ("sigkill-random", None)]
    every = [("sigterm-random", None), ("sigkill-random", None),
             *((kind, point) for kind in ("sigterm-in-save", "sigkill-in-save") for point in POINTS)]
    faults = first
    while len(faults) < n:
        faults += rng.sample(every, len(every))
    return faults[:n]


def check_picked_checkpoint(output_dir: Path, target) -> int:
    """The step of the checkpoint the trainer would resume from, after checking it is complete
    and loads into a drafter."""
    path = latest_checkpoint(output_dir)
    assert path is not None, f"no complete checkpoint in {output_dir}"
    assert sorted(p.name for p in path.iterdir()) == sorted(CHECKPOINT_FILES)
    step = int(path.name.split("-")[1])
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == step
    load_drafter(path, target)  # safetensors parse, and every trainable weight is there
    import torch

    state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    assert state["trainer"]["step"] == step and state["trainer"]["optimizer"]["state"]
    assert set(state) == {"trainer", "data", "rng"}
    return step


def writable_by_others(output_dir: Path) -> list[str]:
    """Paths under `output_dir` that a group member or another user could change: writable by
    them, in directories they can enter (a crash's private temp dir keeps its files out of reach)."""
    found = []
    for path in [output_dir, *output_dir.rglob("*")]:
        enterable = all(stat.S_IMODE(parent.stat().st_mode) & (stat.S_IXGRP | stat.S_IXOTH)
                        for parent in path.parents if output_dir in (parent, *parent.parents))
        mode = stat.S_IMODE(path.lstat().st_mode)
        if enterable and mode & (stat.S_IWGRP | stat.S_IWOTH):
            found.append(f"{path} {mode:o}")
    return found


def check_modes(output_dir: Path) -> None:
    """Nothing writable by group or others; complete checkpoints are exactly 0750/0640 (umask 000)."""
    assert writable_by_others(output_dir) == []
    for path in (output_dir / CHECKPOINT_DIR).glob("step-*"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o750, path
        for f in path.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o640, f
    assert stat.S_IMODE((output_dir / "status.json").stat().st_mode) == 0o640


def leftovers(output_dir: Path) -> set[str]:
    root = output_dir / CHECKPOINT_DIR
    return {p.name for p in root.iterdir() if p.name.startswith(".")} if root.is_dir() else set()


@pytest.fixture(scope="module")
def target():
    return load_target(prepare_assets() / "target")


# Under make test-reliability only: 80 s of randomised stops and crashes; make test keeps the stop's
# checkpoint through tests/dflash/training/test_train.py and tests/pipeline/test_pipeline_run.py.
@pytest.mark.reliability_full
def test_no_stop_or_crash_loses_the_saved_step(tmp_path, target):
    n = trials(4, 30)
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    config = write_config(tmp_path, "chain")
    output_dir = tmp_path / "run"
    # Made world-writable on purpose: the trainer must close it.
    output_dir.mkdir(mode=0o777)
    os.chmod(output_dir, 0o777)
    saved: int | None = None       # the step the next run must resume at
    stale: set[str] = set()        # temp dirs a crash left behind
    hit = []
    for i, (kind, point) in enumerate(schedule(n, rng)):
        where = f"trial {i} ({kind} {point or ''}, seed {seed})"
        marker = tmp_path / f"pause-{i}"
        on_save = str(rng.randint(1, 2))
        hook = ["--pause-at", point, "--on-save", on_save, "--marker", str(marker)] if point else []
        run = Trainer(config, tmp_path / f"run-{i}.log", *hook)
        try:
            first_step = run.first("step")["step"]
            events = run.events()
            # The run resumed where the last one saved, and a crash's temp dirs are gone.
            if saved is None:
                assert first_step == 1, where
            else:
                assert [e["step"] for e in events if e["event"] == "resume"] == [saved], where
                assert first_step == saved + 1, where
            assert not stale & leftovers(output_dir), where

            if point:
                run.wait_for(lambda m=marker: m.exists() and m.read_text(), f"pause at {point}")
                paused_step = int(marker.read_text().split()[1])
            else:
                time.sleep(rng.uniform(0, 1.5))
            before = run.events()
            run.signal(signal.SIGTERM if kind.startswith("sigterm") else signal.SIGKILL)
            code = run.wait()
        finally:
            run.kill()
        events = run.events()
        picked = check_picked_checkpoint(output_dir, target)
        if kind.startswith("sigterm"):
            assert code == 0, f"{where}: exit {code}\n{run.log.read_text()[-3000:]}"
            assert events[-1]["event"] == "stop" and events[-1]["reason"] == "signal SIGTERM", where
            # The saved step is the last step logged before the exit.
            assert picked == steps_of(events, "step")[-1] == events[-1]["step"], where
            assert json.loads((output_dir / "status.json").read_text())["state"] == "stopped", where
            if point:
                assert marker.read_text().splitlines()[-1] == "signalled", where
                # The write runs on a thread, training on meanwhile: the stop waited for it to finish, then
                # saved the last step logged.
                assert paused_step in steps_of(events, "checkpoint") and picked >= paused_step, where
            assert not leftovers(output_dir), where
        else:
            assert code == -signal.SIGKILL, where
            saves = steps_of(before, "resume") + steps_of(before, "checkpoint")
            last_save = max(saves) if saves else None
            if point in BEFORE_RENAME:
                # The write in progress is not picked; the previous save is.
                assert picked == last_save, f"{where}: picked {picked}, last save {last_save}"
                assert paused_step > picked, where
                assert any(name.endswith(f"step-{paused_step:08d}-{run.proc.pid}")
                           for name in leftovers(output_dir)), where
            elif point:
                # Caught after the rename: the new checkpoint is in place and picked.
                assert picked == paused_step, where
            else:
                assert last_save is None or picked >= last_save, where
                assert picked <= steps_of(events, "step")[-1], where
            stale = leftovers(output_dir)
        check_modes(output_dir)
        hit.append(f"{kind}@{point}" if point else kind)
        saved = picked

    # One more run: it resumes at the last saved step and continues.
    final = Trainer(write_config(tmp_path, "final", max_steps_per_run=2), tmp_path / "final.log")
    try:
        assert final.wait() == 0
    finally:
        final.kill()
    events = final.events()
    assert steps_of(events, "resume") == [saved] and steps_of(events, "step") == [saved + 1, saved + 2]
    assert not leftovers(output_dir)
    check_modes(output_dir)
    print(f"checkpoint faults: {n} trials, seed {seed}, faults {dict(collections.Counter(hit))}")


# The run's own directories and files are private (0750/0640, less a stricter umask); a parent it makes on the
# way to its output directory (runs/) stays searchable (0755, less the umask), so a run user reaches its own.
@pytest.mark.parametrize("umask, parent_mode, dir_mode, file_mode", [
    (0o000, 0o755, 0o750, 0o640), (0o027, 0o750, 0o750, 0o640), (0o077, 0o700, 0o700, 0o600)])
def test_checkpoints_and_status_are_never_writable_by_others(tmp_path, umask, parent_mode, dir_mode,
                                                            file_mode):
    import torch

    from dflash_ops.core.runtime import StatusFile
    from dflash_ops.training.checkpoint import save_checkpoint

    output_dir = tmp_path / "runs" / "main"
    previous = os.umask(umask)
    try:
        status = StatusFile(output_dir)
        status.update(state="running")
        path = save_checkpoint(output_dir, 1, {"w": torch.zeros(2)}, {"trainer": {"step": 1}}, "x: 1\n", {},
                               keep=2)
    finally:
        os.umask(previous)
    assert writable_by_others(tmp_path) == []
    assert stat.S_IMODE((tmp_path / "runs").stat().st_mode) == parent_mode
    for directory in (output_dir, output_dir / CHECKPOINT_DIR, path):
        assert stat.S_IMODE(directory.stat().st_mode) == dir_mode, directory
    for f in [output_dir / "status.json", *path.iterdir()]:
        assert stat.S_IMODE(f.stat().st_mode) == file_mode, f
    # An output dir made writable by others is closed again by the next run.
    os.chmod(output_dir, 0o777)
    StatusFile(output_dir).update(state="running")
    assert stat.S_IMODE(output_dir.stat().st_mode) == 0o750
