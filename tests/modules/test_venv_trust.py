"""Root runs only root's code: the start (training_run, and the boot's start again) refuses a venv another
user could change before anything is stopped - its pyvenv.cfg, its site-packages or a directory on their way,
an entry in site-packages (a .pth file, whose import lines `site` runs before the run's first line), a
directory a .pth file puts on the path - for the release's venv, a venv python run directly (regeneration,
capture) and an engine's venv (regenerate_data.yml's --engine-python). A .pth file planted by that user never
runs as root."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from module_runner import FAKE_RUN, alive
from test_run_resume import Box

from ansible_collections.dflash.ops.plugins.module_utils import run_resume, safe_paths

NOBODY = 65534


def make_venv(path: Path) -> Path:
    """A venv as dflash_env makes it (root's, without pip); its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    return path / "bin" / "python"


def site_packages(venv: Path) -> Path:
    [site] = (venv / "lib").glob("python*/site-packages")
    return site


def plant_pth(site: Path, marker: Path, owner=NOBODY) -> Path:
    """What that user's .pth file does at the interpreter's start: write the uid it runs as."""
    pth = site / "zz-planted.pth"
    pth.write_text(f"import os; open({str(marker)!r}, 'w').write(str(os.getuid()))\n")
    os.chown(pth, owner, owner)
    return pth


@pytest.fixture
def venv(tmp_path):
    return make_venv(tmp_path / "opt" / "venv")


def release(tmp_path, python):
    """A release whose run.sh execs the venv's python, root's."""
    tree = tmp_path / "opt" / "releases" / "r1"
    tree.mkdir(parents=True)
    run_sh = tree / "run.sh"
    run_sh.write_text(f"#!/bin/sh\nexec {python} {FAKE_RUN} --step-after 0.2\n")
    run_sh.chmod(0o755)
    return tree


def test_a_venv_of_roots_starts_and_its_own_pth_files_run(run, tmp_path, venv):
    marker = tmp_path / "pth-ran"
    plant_pth(site_packages(venv.parent.parent), marker, owner=0)  # root's own: what pip of root's writes
    tree = release(tmp_path, venv)
    result, rc = run.call(command=[str(tree / "run.sh")], chdir=str(tree), interpreter=[str(venv)])
    assert rc == 0 and result["status"] == "running", result
    assert marker.read_text() == "0"


CHANGES = ["site-packages of another user", "a .pth file of another user", "pyvenv.cfg writable by its group",
           "lib of another user", "a directory a .pth file adds, of another user", "the engine's venv",
           "the venv python run directly"]


@pytest.mark.parametrize("change", CHANGES)
def test_a_venv_another_user_could_change_is_refused_and_nothing_is_stopped(run, tmp_path, venv, change):
    first = run.start()
    prefix = venv.parent.parent
    site = site_packages(prefix)
    marker = tmp_path / "pth-ran"
    interpreters, command = [str(venv)], None
    if change == "site-packages of another user":
        os.chown(site, NOBODY, NOBODY)
        culprit = plant_pth(site, marker).parent
    elif change == "a .pth file of another user":
        culprit = plant_pth(site, marker)
    elif change == "pyvenv.cfg writable by its group":
        culprit = prefix / "pyvenv.cfg"
        culprit.chmod(0o664)
    elif change == "lib of another user":
        culprit = prefix / "lib"
        os.chown(culprit, NOBODY, NOBODY)
    elif change == "a directory a .pth file adds, of another user":
        culprit = tmp_path / "extra"
        culprit.mkdir()
        os.chown(culprit, NOBODY, NOBODY)
        (site / "extra.pth").write_text(f"{culprit}\n")
    elif change == "the engine's venv":
        engine = make_venv(tmp_path / "opt" / "engine-venv")
        culprit = site_packages(engine.parent.parent)
        os.chown(culprit, NOBODY, NOBODY)
        plant_pth(culprit, marker)
        interpreters.append(str(engine))
    else:  # regenerate_data.yml and capture_features.yml run the venv's python as the command
        os.chown(site, NOBODY, NOBODY)
        culprit = plant_pth(site, marker).parent
        command, interpreters = [str(venv), FAKE_RUN, "--step-after", "0.2"], []
    tree = release(tmp_path, venv)
    result, rc = run.call(state="restarted", expect_pid=first["pid"], chdir=str(tree),
                          interpreter=interpreters, command=command or [str(tree / "run.sh")])
    assert rc == 1, result
    assert str(culprit) in result["msg"] and "chmod go-w" in result["msg"], result["msg"]
    assert "nothing was signalled or started" in result["msg"]
    assert alive(first["pid"]) and json.loads(run.pidfile.read_text())["pid"] == first["pid"]
    assert not marker.exists()


def test_a_venv_with_the_systems_site_packages_is_refused(tmp_path):
    python = make_venv(tmp_path / "venv")
    config = python.parent.parent / "pyvenv.cfg"
    config.write_text(config.read_text().replace("include-system-site-packages = false",
                                                 "include-system-site-packages = true"))
    assert "--system-site-packages" in safe_paths.venv_problem(str(python))
    assert safe_paths.venv_problem(sys.executable) is None  # this checkout's own venv is root's


def test_the_boots_start_again_refuses_a_venv_another_user_changed(tmp_path, processes, monkeypatch):
    """The start file of a run keeps its interpreter (one path in an earlier release's start file); at the
    boot the planted .pth file never runs and the boot result says why."""
    box = Box(tmp_path, processes)
    venv = make_venv(tmp_path / "venv")
    tree = release(tmp_path, venv)
    box.spec.update(command=[str(tree / "run.sh")], chdir=str(tree), interpreter=str(venv), gpus=[])
    (box.dir / "main.boot.json").write_text(json.dumps(box.spec))
    before = box.died({"state": "running"})
    site = site_packages(venv.parent.parent)
    os.chown(site, NOBODY, NOBODY)
    marker = tmp_path / "pth-ran"
    plant_pth(site, marker)
    [result] = run_resume.resume_all(str(box.dir))
    assert result["outcome"] == "failed", result
    assert str(site) in result["msg"] and "owned by uid 65534" in result["msg"], result["msg"]
    assert not marker.exists() and not alive(before)
