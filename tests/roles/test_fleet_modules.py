"""The helpers of the roles' modules (dflash.ops.dflash_env_venv, dflash.ops.dflash_release_tree), on local
files."""

import io
import os
import subprocess
import sys
import tarfile

import pytest

from ansible_collections.dflash.ops.plugins.modules import dflash_env_venv, dflash_release_tree


@pytest.fixture
def venv(tmp_path):
    path = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = subprocess.run([str(path / "bin" / "python"), "-c", code],
                             check=True, capture_output=True, text=True).stdout.strip()
    return path, purelib


def test_a_build_of_the_project_an_earlier_version_installed_is_removed_file_by_file(venv):
    """The venv holds dependencies only: the trainer's code comes with the release. A dflash_ops build that
    an earlier version unpacked into the venv is removed (the files its RECORD lists, nothing else)."""
    path, purelib = venv
    info = os.path.join(purelib, "dflash_ops-0.1.0.dist-info")
    os.makedirs(os.path.join(purelib, "dflash"))
    os.makedirs(info)
    files = {"dflash/__init__.py": "", "dflash/train.py": "", "../../../bin/pvesim": "#!/bin/sh\n"}
    for rel, text in files.items():
        with open(os.path.normpath(os.path.join(purelib, rel)), "w") as fh:
            fh.write(text)
    with open(os.path.join(info, "RECORD"), "w") as fh:
        fh.write("".join(f"{rel},," + "\n" for rel in files) + "dflash_ops-0.1.0.dist-info/RECORD,,\n"
                 + "../../../../outside-the-venv,,\n")
    outside = os.path.normpath(os.path.join(purelib, "../../../../outside-the-venv"))
    with open(outside, "w") as fh:
        fh.write("")
    kept = os.path.join(purelib, "torch_stand_in.py")
    with open(kept, "w") as fh:
        fh.write("")
    assert dflash_env_venv.installed_records(purelib, "dflash_ops") == [info]
    dflash_env_venv.remove_install(str(path), purelib, info)
    assert not os.path.exists(os.path.join(purelib, "dflash"))
    assert not os.path.exists(info)
    assert not os.path.exists(os.path.join(str(path), "bin", "pvesim"))
    assert os.path.exists(kept)
    assert dflash_env_venv.installed_records(purelib, "dflash_ops") == []
    # A RECORD line pointing outside the venv is never followed.
    assert os.path.exists(outside)


def archive(entries):
    """A tar.gz of `entries`: (name, text or None for a symlink to /etc/passwd, mode)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text, mode in entries:
            info = tarfile.TarInfo(name)
            info.mode = mode
            if text is None:
                info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(info)
            else:
                info.size = len(text)
                tar.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


def test_unpack_sets_modes_and_refuses_links_and_escapes(tmp_path):
    dest = tmp_path / "staging"
    entries = [("run.sh", "#!/bin/sh\n", 0o777), ("dflash_ops/a.py", "", 0o666)]
    dflash_release_tree.unpack(archive(entries), str(dest))
    assert oct(os.stat(dest / "run.sh").st_mode & 0o777) == oct(0o755)
    assert oct(os.stat(dest / "dflash_ops" / "a.py").st_mode & 0o777) == oct(0o644)
    assert oct(os.stat(dest / "dflash_ops").st_mode & 0o777) == oct(0o755)
    for bad in ([("link", None, 0o777)], [("../out.py", "", 0o644)], [("/abs.py", "", 0o644)]):
        with pytest.raises(ValueError, match="not a plain path"):
            dflash_release_tree.unpack(archive(bad), str(tmp_path / "bad"))
    assert not (tmp_path / "out.py").exists()


def test_unsafe_entries_names_group_or_other_writable_files(tmp_path):
    (tmp_path / "ok.py").write_text("")
    os.chmod(tmp_path, 0o755)
    os.chmod(tmp_path / "ok.py", 0o644)
    assert dflash_release_tree.unsafe_entries(str(tmp_path)) == []
    os.chmod(tmp_path / "ok.py", 0o646)
    found = dflash_release_tree.unsafe_entries(str(tmp_path))
    assert [e.split()[0] for e in found] == [str(tmp_path / "ok.py")]


def test_pruning_keeps_the_newest_and_the_protected_releases_and_drops_staging(tmp_path):
    for i, name in enumerate(["r1", "r2", "r3", "r4", ".staging-r5"]):
        (tmp_path / name).mkdir()
        os.utime(tmp_path / name, (1000 + i, 1000 + i))
    doomed = dflash_release_tree.doomed(str(tmp_path), 2, {str(tmp_path / "r1")})
    assert doomed == [str(tmp_path / "r2"), str(tmp_path / ".staging-r5")]
    assert dflash_release_tree.doomed(str(tmp_path), 0, set()) == [str(tmp_path / ".staging-r5")]
