"""The trainer writes nothing through a symbolic link or into another user's directory: its output
directory, checkpoints, TensorBoard directory, status.json and metrics.jsonl (dflash_ops.core.safe_paths)."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from dflash_ops.core.config import ConfigError, config_from_dict, load_config
from dflash_ops.core.runtime import ensure_dir, write_file
from dflash_ops.core.safe_paths import UnsafePath
from dflash_ops.run.main import EXIT_BAD_INPUT, run_single_process
from dflash_ops.training.checkpoint import latest_checkpoint, list_checkpoints
from dflash_ops.training.telemetry import RunTelemetry


@pytest.fixture
def elsewhere(tmp_path):
    """A directory root owns outside the run's (a stand-in for /etc), with a file in it."""
    path = tmp_path / "etc"
    path.mkdir()
    (path / "passwd").write_text("root:x:0:0\n")
    return path


def untouched(directory):
    return sorted(p.name for p in directory.iterdir()) == ["passwd"] and \
        (directory / "passwd").read_text() == "root:x:0:0\n"


@pytest.mark.parametrize("link", ["output_dir", "parent", "checkpoints", "tensorboard"])
def test_validate_names_run_output_dir_when_a_part_of_it_is_a_symlink(tiny_config, tmp_path, elsewhere, link):
    out = tmp_path / "runs" / "main"
    if link == "parent":
        (tmp_path / "runs").symlink_to(elsewhere)
    elif link == "output_dir":
        out.parent.mkdir()
        out.symlink_to(elsewhere)
    else:
        out.mkdir(parents=True)
        (out / link).symlink_to(elsewhere)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(out)))
    with pytest.raises(ConfigError) as failure:
        load_config(config)
    assert failure.value.key == "run.output_dir"
    assert "symbolic link" in failure.value.message and str(elsewhere) in failure.value.message
    assert untouched(elsewhere)


def test_a_run_whose_checkpoints_are_a_symlink_fails_clearly_and_writes_nothing_there(
        tiny_config, tmp_path, elsewhere, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").symlink_to(elsewhere)
    (elsewhere / "step-00000009").mkdir()  # what a planted "checkpoint" would look like
    code = run_single_process(config_from_dict(tiny_config(out, optim={"total_steps": 2})))
    assert code == EXIT_BAD_INPUT
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "failed" and "symbolic link" in status["error"]
    assert "checkpoints" in capsys.readouterr().err
    assert sorted(p.name for p in elsewhere.iterdir()) == ["passwd", "step-00000009"]


def test_a_symlinked_step_directory_is_never_a_checkpoint(tiny_config, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_single_process(config_from_dict(tiny_config(out, optim={"total_steps": 2}))) == 0
    saved = latest_checkpoint(out)
    (out / "checkpoints" / "step-00009999").symlink_to(saved)
    assert list_checkpoints(out) == [saved] and latest_checkpoint(out) == saved


def test_files_are_never_written_through_a_symlink(tmp_path, elsewhere):
    out = ensure_dir(tmp_path / "run")
    (out / "status.json.tmp").symlink_to(elsewhere / "passwd")
    with pytest.raises(UnsafePath, match="symbolic link"):
        write_file(out / "status.json.tmp", "{}")
    (out / "metrics.jsonl").symlink_to(elsewhere / "passwd")
    with pytest.raises(UnsafePath, match="symbolic link"):
        RunTelemetry(out).record("train", 1, {"loss": 1.0})
    assert untouched(elsewhere)


def test_a_directory_of_another_user_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    os.chown(out, 65534, 65534)
    with pytest.raises(UnsafePath, match="owned by uid 65534"):
        ensure_dir(out)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafePath, match="every user can write to"):
        ensure_dir(shared / "run")


def test_a_parent_swapped_for_a_symlink_in_another_users_directory_redirects_no_write(tmp_path, elsewhere):
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, 65534, 65534)
    (elsewhere / "main").mkdir()
    (home / "runs").symlink_to(elsewhere)  # what that user put in place of the runs' directory
    with pytest.raises(UnsafePath, match="symbolic link"):
        ensure_dir(home / "runs" / "main")
    with pytest.raises(UnsafePath, match="uid 65534"):
        write_file(home / "runs" / "main" / "status.json", "{}")
    assert sorted(p.name for p in elsewhere.iterdir()) == ["main", "passwd"]
    assert not any((elsewhere / "main").iterdir())


def test_a_directory_on_the_way_in_a_directory_every_user_can_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    (shared / "runs" / "run").mkdir(parents=True)
    shared.chmod(0o777)
    with pytest.raises(UnsafePath, match="every user can write to"):
        ensure_dir(shared / "runs" / "run")


def test_a_link_on_the_way_that_only_root_could_have_made_is_followed(tmp_path):
    (tmp_path / "srv" / "runs").mkdir(parents=True)
    (tmp_path / "data").symlink_to(tmp_path / "srv")
    write_file(ensure_dir(tmp_path / "data" / "runs" / "run") / "status.json", "{}")
    assert (tmp_path / "srv" / "runs" / "run" / "status.json").read_text() == "{}"
