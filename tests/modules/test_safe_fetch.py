"""What the controller takes from a container follows no link (plugins/module_utils/safe_fetch.py): as
root, a run's file is read only when it is root's or the run's user's and reached without a link; a link
to /etc/shadow planted by the run's user, another user's file or directory, a link inside the TensorBoard
directory are refused by name and nothing is returned. On the controller a directory of another user's
(`nobody`) is refused, a missing one is made 0700, and each file lands 0600 through a rename that replaces
a link planted at its name. The export's checks: other files, code that is not the release's, auto_map."""

from __future__ import annotations

import hashlib
import os
import stat

import pytest

from ansible_collections.dflash.ops.plugins.action.dflash_export import auto_map_problems
from ansible_collections.dflash.ops.plugins.action.dflash_fetch import controller_path, known_copies
from ansible_collections.dflash.ops.plugins.module_utils.export_files import (
    AUTO_MAP,
    EXPORT_FILES,
    export_problems,
    trusted_checksums,
)
from ansible_collections.dflash.ops.plugins.module_utils.safe_fetch import (
    open_private_directory,
    read_run_files,
    write_private,
)
from ansible_collections.dflash.ops.plugins.module_utils.safe_paths import UnsafePath

NOBODY = 65534
RUN_USER = 994  # the run's user (dflash_run_user), a uid of its own


@pytest.fixture
def run_dir(tmp_path):
    """A run's output directory as a run as RUN_USER leaves it: its metrics and TensorBoard events."""
    top = tmp_path / "runs"
    top.mkdir()
    run = top / "main"
    (run / "tensorboard").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    (run / "tensorboard" / "events.out.tfevents.1.ct200").write_bytes(b"events")
    for path in (run, run / "tensorboard", run / "metrics.jsonl", *(run / "tensorboard").iterdir()):
        os.chown(path, RUN_USER, RUN_USER)
    return run


def test_the_runs_files_are_read_when_they_are_its_users_or_roots(run_dir):
    found = read_run_files(str(run_dir), ["metrics.jsonl", "tensorboard", "missing.jsonl"], owner=RUN_USER)
    assert found == {"metrics.jsonl": b'{"kind": "train", "step": 1}\n',
                     "tensorboard/events.out.tfevents.1.ct200": b"events"}
    # Without the run's user named, its files are nobody the fetch trusts.
    with pytest.raises(UnsafePath, match=f"owned by uid {RUN_USER}"):
        read_run_files(str(run_dir), ["metrics.jsonl"])


@pytest.mark.parametrize("where", ["metrics.jsonl", "tensorboard/events.out.tfevents.1.ct200"])
def test_a_link_planted_by_the_runs_user_is_refused(run_dir, where):
    (run_dir / where).unlink()
    (run_dir / where).symlink_to("/etc/shadow")
    os.lchown(run_dir / where, RUN_USER, RUN_USER)
    with pytest.raises(UnsafePath, match=r"is a symbolic link \(to /etc/shadow\)"):
        read_run_files(str(run_dir), ["metrics.jsonl", "tensorboard"], owner=RUN_USER)


def test_a_linked_directory_another_users_file_or_a_fifo_is_refused(run_dir, tmp_path):
    events = run_dir / "tensorboard"
    (tmp_path / "elsewhere").mkdir()
    os.rename(events, tmp_path / "elsewhere" / "tb")
    events.symlink_to(tmp_path / "elsewhere" / "tb")
    with pytest.raises(UnsafePath, match="symbolic link"):
        read_run_files(str(run_dir), ["tensorboard"], owner=RUN_USER)
    events.unlink()
    os.chown(run_dir / "metrics.jsonl", NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match=f"owned by uid {NOBODY}"):
        read_run_files(str(run_dir), ["metrics.jsonl"], owner=RUN_USER)
    (run_dir / "metrics.jsonl").unlink()
    os.mkfifo(run_dir / "metrics.jsonl")
    os.chown(run_dir / "metrics.jsonl", RUN_USER, RUN_USER)
    with pytest.raises(UnsafePath, match="not a regular file"):
        read_run_files(str(run_dir), ["metrics.jsonl"], owner=RUN_USER)


def test_an_output_directory_reached_through_another_users_directory_is_refused(run_dir):
    os.chown(run_dir.parent, NOBODY, NOBODY)
    with pytest.raises(UnsafePath, match=f"owned by uid {NOBODY}"):
        read_run_files(str(run_dir), ["metrics.jsonl"], owner=RUN_USER)


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_controllers_copies_land_private_and_replace_a_planted_link(tmp_path):
    victim = tmp_path / "shadow"
    victim.write_text("root's\n")
    dest = tmp_path / "metrics"
    write_private(str(dest), "ct200.metrics.jsonl", b"first\n")
    assert mode(dest) == 0o700 and mode(dest / "ct200.metrics.jsonl") == 0o600
    (dest / "ct200.metrics.jsonl").unlink()
    (dest / "ct200.metrics.jsonl").symlink_to(victim)
    write_private(str(dest), "ct200.metrics.jsonl", b"second\n")
    write_private(str(dest), "ct200/events.out.tfevents.1", b"events")
    assert victim.read_text() == "root's\n"
    assert (dest / "ct200.metrics.jsonl").read_bytes() == b"second\n"
    assert mode(dest / "ct200") == 0o700 and mode(dest / "ct200" / "events.out.tfevents.1") == 0o600
    assert sorted(p.name for p in dest.iterdir()) == ["ct200", "ct200.metrics.jsonl"]  # no temporary file
    paths = {"metrics.jsonl": "ct200.metrics.jsonl", "tensorboard": "ct200"}
    assert known_copies(str(dest), paths) == {
        "metrics.jsonl": hashlib.sha256(b"second\n").hexdigest(),
        "tensorboard/events.out.tfevents.1": hashlib.sha256(b"events").hexdigest()}
    assert controller_path("tensorboard/events.out.tfevents.1", paths) == "ct200/events.out.tfevents.1"
    assert controller_path("metrics.jsonl", paths) == "ct200.metrics.jsonl"


@pytest.mark.parametrize("case", ["another user's", "group-writable", "a link"])
def test_a_controller_directory_another_user_could_change_is_refused(tmp_path, case):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    dest = tmp_path / "metrics"
    if case == "a link":
        dest.symlink_to(mine)
    else:
        dest.mkdir(mode=0o700)
        if case == "another user's":
            os.chown(dest, NOBODY, NOBODY)
        else:
            dest.chmod(0o770)
    with pytest.raises(UnsafePath):
        write_private(str(dest), "ct200.metrics.jsonl", b"data")
    with pytest.raises(UnsafePath):
        os.close(open_private_directory(str(dest)))
    assert list(mine.iterdir()) == []
    assert not os.path.lexists(dest / "ct200.metrics.jsonl") or dest.is_symlink()


def test_an_export_with_other_files_code_or_auto_map_is_refused(tmp_path):
    code = {"modeling_dflash.py": "a" * 64, "drafter.py": "b" * 64}
    files = {name: "c" * 64 for name in EXPORT_FILES} | code
    assert export_problems(files, code) == []
    assert export_problems(files | {"modeling_dflash.py": "d" * 64}, code) == [
        f"modeling_dflash.py (sha256 {'d' * 64}) is not the release's dflash_ops/model/modeling_dflash.py "
        f"(sha256 {'a' * 64})"]
    assert export_problems(files | {"__init__.py": "e" * 64}, code) == ["__init__.py is no file of an export"]
    config = tmp_path / "config.json"
    config.write_text('{"auto_map": {"AutoModel": "evil.Model"}}')
    assert auto_map_problems(config) == [
        f"config.json's auto_map is {{'AutoModel': 'evil.Model'}}, not {AUTO_MAP}"]
    config.write_text('{"auto_map": {"AutoModel": "modeling_dflash.DFlashDraftModel"}}')
    assert auto_map_problems(config) == []


def test_an_exports_files_are_read_as_roots_alone(tmp_path):
    export = tmp_path / "exports" / "step-00000010"
    export.mkdir(parents=True, mode=0o700)
    (export / "config.json").write_text("{}")
    assert set(trusted_checksums(str(export))) == {"config.json"}
    (export / "modeling_dflash.py").symlink_to(tmp_path / "elsewhere.py")
    with pytest.raises(UnsafePath, match="symbolic link"):
        trusted_checksums(str(export))
    (export / "modeling_dflash.py").unlink()
    (export / "modeling_dflash.py").write_text("x")
    os.chown(export / "modeling_dflash.py", RUN_USER, RUN_USER)
    with pytest.raises(UnsafePath, match=f"owned by uid {RUN_USER}"):
        trusted_checksums(str(export))
