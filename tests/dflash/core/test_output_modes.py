"""Private by default: a run's outputs (its output directory, status.json, metrics.jsonl, TensorBoard events,
its checkpoints) are 0750 directories and 0640 files, whatever the umask it was started with, so another user
of the container (`nobody`) reads none of them; with DFLASH_OUTPUT_GROUP (dflash_run_output_group) they are
that group's, which reads all of them, and still nobody else."""

from __future__ import annotations

import grp
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from dflash_ops.core.config import config_from_dict
from dflash_ops.core.runtime import OUTPUT_GROUP_ENV
from dflash_ops.run.main import run_single_process

NOBODY = 65534
# A group of this machine with no member the test cares about: the output group of the shared case.
SHARED_GROUP = "video"
READER = """import json, os, sys
readable = []
for root, dirs, files in os.walk(sys.argv[1]):
    readable.append(root)
    for name in files:
        try:
            with open(os.path.join(root, name), "rb") as f:
                f.read(1)
            readable.append(os.path.join(root, name))
        except OSError:
            pass
print(json.dumps(readable))
"""


def readable_by(uid, groups, top):
    """The directories `uid` (in `groups`) can list and the files it can read under `top`."""
    def become():
        os.setgroups(groups)
        os.setgid(groups[0] if groups else NOBODY)
        os.setuid(uid)
    done = subprocess.run(["/usr/bin/python3", "-c", READER, str(top)], preexec_fn=become,
                          capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout)


@pytest.fixture
def base():
    """A directory every user can enter (tmp_path is root's 0700: nobody could read anything in it)."""
    path = Path(tempfile.mkdtemp(prefix="dflash-modes-"))
    path.chmod(0o755)
    (path / "canary").write_text("anyone may read this\n")
    yield path
    shutil.rmtree(path)


def train(tiny_config, out, monkeypatch, group=None):
    if group:
        monkeypatch.setenv(OUTPUT_GROUP_ENV, group)
    else:
        monkeypatch.delenv(OUTPUT_GROUP_ENV, raising=False)
    old = os.umask(0o022)  # the usual umask: what the modes must not depend on
    try:
        assert run_single_process(config_from_dict(tiny_config(out, optim={"total_steps": 2}))) == 0
    finally:
        os.umask(old)


def outputs(out):
    paths = [out] + sorted(out.rglob("*"))
    assert {"status.json", "metrics.jsonl"} <= {p.name for p in paths}
    assert any(p.name == "model.safetensors" for p in paths), paths  # a checkpoint's weights
    return paths


def test_nobody_reads_any_of_a_runs_outputs(tiny_config, base, monkeypatch):
    out = base / "runs" / "main"
    train(tiny_config, out, monkeypatch)
    # nobody reaches the base and reads what is open to all there: the outputs' own modes are what stop it
    assert str(base / "canary") in readable_by(NOBODY, [], base)
    for path in outputs(out):
        mode = path.stat().st_mode & 0o7777
        assert mode == (0o750 if path.is_dir() else 0o640), (path, oct(mode))
    assert readable_by(NOBODY, [], out) == []


def test_the_output_group_reads_them_all_and_still_no_one_else(tiny_config, base, monkeypatch):
    gid = grp.getgrnam(SHARED_GROUP).gr_gid
    out = base / "runs" / "main"
    train(tiny_config, out, monkeypatch, group=SHARED_GROUP)
    paths = outputs(out)
    for path in paths:
        assert path.stat().st_gid == gid, path
        mode = path.stat().st_mode
        assert mode & 0o057 == (0o050 if path.is_dir() else 0o040), (path, oct(mode))
    assert sorted(readable_by(NOBODY, [gid], out)) == sorted(str(p) for p in paths)
    assert readable_by(NOBODY, [], out) == []


def test_a_group_no_longer_named_reads_no_more(tiny_config, base, monkeypatch):
    gid = grp.getgrnam(SHARED_GROUP).gr_gid
    out = base / "runs" / "main"
    train(tiny_config, out, monkeypatch, group=SHARED_GROUP)
    train(tiny_config, out, monkeypatch)  # the next run of that directory, without dflash_run_output_group
    assert (out.stat().st_gid, out.stat().st_mode & 0o7777) == (os.getegid(), 0o750)
    assert readable_by(NOBODY, [gid], out) == []
