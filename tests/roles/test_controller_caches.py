"""The controller's cache of release archives stays bounded: beyond the most recently used
entries, those unused for a day are removed; a use refreshes an entry; in-flight builds are left."""

import base64
import importlib.util
import io
import os
import shutil
import tarfile
import time

import pytest

from pvesim.fleet import REPO

DAY = 24 * 3600


def load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pack_release = load(REPO / "ansible_collections" / "dflash" / "ops" / "plugins" / "plugin_utils"
                    / "release_pack.py")


def aged(path, days):
    stamp = time.time() - days * DAY
    os.utime(path, (stamp, stamp))


def test_old_release_archives_beyond_the_newest_are_pruned_with_their_base64(tmp_path):
    for i in range(6):
        for ext in ("", ".b64"):
            (tmp_path / f"r{i}.tar.gz{ext}").write_text("x")
        aged(tmp_path / f"r{i}.tar.gz", days=i)  # r0 used now ... r5 five days ago
    (tmp_path / "r9.tar.gz.123.tmp").write_text("another packer's work")
    removed = pack_release.prune(str(tmp_path), keep=2)
    assert sorted(removed) == ["r2", "r3", "r4", "r5"]
    assert sorted(os.listdir(tmp_path)) == ["r0.tar.gz", "r0.tar.gz.b64", "r1.tar.gz", "r1.tar.gz.b64",
                                            "r9.tar.gz.123.tmp"]


def test_archives_used_within_a_day_are_kept_whatever_their_number(tmp_path):
    for i in range(5):
        (tmp_path / f"r{i}.tar.gz").write_text("x")
    assert pack_release.prune(str(tmp_path), keep=1) == []
    assert len(os.listdir(tmp_path)) == 5


def test_packing_refreshes_the_archive_it_uses_and_prunes_the_stale_ones(tmp_path, monkeypatch):
    code = tmp_path / "pkg"
    code.mkdir()
    (code / "__init__.py").write_text("")
    build = tmp_path / "build"
    first = pack_release.pack(str(code), str(build), "rev", {"config.yaml": "a: 1\n"})
    aged(first["archive"], days=3)
    aged(first["archive_b64"], days=3)
    monkeypatch.setattr(pack_release, "KEEP_ARCHIVES", 0)
    # Reused three days later: refreshed, so kept even with nothing else kept.
    again = pack_release.pack(str(code), str(build), "rev", {"config.yaml": "a: 1\n"})
    assert again["id"] == first["id"] and os.path.exists(again["archive_b64"])
    assert time.time() - os.stat(again["archive"]).st_mtime < 60
    # A new config three days on: the old archive goes, the new one stays.
    aged(first["archive"], days=3)
    other = pack_release.pack(str(code), str(build), "rev", {"config.yaml": "a: 2\n"})
    assert sorted(os.listdir(build)) == [f"{other['id']}.tar.gz", f"{other['id']}.tar.gz.b64"]


def run_sh_of(encoded_path):
    """run.sh of the archive whose base64 text is in `encoded_path`."""
    data = base64.b64decode(open(encoded_path, "rb").read())
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return tar.extractfile("run.sh").read().decode()


@pytest.mark.parametrize("tampered", [".b64", ".tar.gz"])
def test_a_cached_archive_is_reused_only_when_its_content_is_the_release(tmp_path, tampered):
    code = tmp_path / "pkg"
    code.mkdir()
    (code / "__init__.py").write_text("")
    real = {"config.yaml": "a: 1\n", "run.sh": "#!/bin/sh\nexec python -m dflash_ops.train\n"}
    first = pack_release.pack(str(code), str(tmp_path / "build"), "rev", real)
    evil = pack_release.pack(str(code), str(tmp_path / "elsewhere"), "rev", {**real, "run.sh": "echo EVIL\n"})
    # Another user of the controller puts the evil archive in place of the real one, under the same id.
    shutil.copy(evil["archive" + ("_b64" if tampered == ".b64" else "")],
                first["archive" + ("_b64" if tampered == ".b64" else "")])
    again = pack_release.pack(str(code), str(tmp_path / "build"), "rev", real)
    assert again["id"] == first["id"]
    assert run_sh_of(again["archive_b64"]) == real["run.sh"]
    assert [problem.split()[0] for problem in again["rebuilt"]] == [first["archive" + (
        "_b64" if tampered == ".b64" else "")]], again["rebuilt"]
    assert base64.b64decode(again["content"]) == open(again["archive"], "rb").read()
    assert again["files"]["run.sh"] == first["files"]["run.sh"]
    # Once rebuilt, it is trusted again and not rebuilt.
    assert pack_release.pack(str(code), str(tmp_path / "build"), "rev", real)["rebuilt"] == []
