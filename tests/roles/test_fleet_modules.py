"""The helpers of the roles' own modules (dflash_env_venv, dflash_release_tree), on local files."""

import io
import os
import subprocess
import sys
import tarfile
import zipfile

import pytest
from roles_support import REPO

sys.path.insert(0, str(REPO / "roles" / "dflash_env" / "library"))
sys.path.insert(0, str(REPO / "roles" / "dflash_release" / "library"))
import dflash_env_venv  # noqa: E402
import dflash_release_tree  # noqa: E402


def wheel(version, files):
    """A pure-Python wheel of `demo_pkg` with `files` ({path: text}) and a console script `demo-cli`."""
    info = f"demo_pkg-{version}.dist-info"
    members = dict(files)
    members[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: demo-pkg\nVersion: {version}\n"
    members[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    members[f"{info}/entry_points.txt"] = "[console_scripts]\ndemo-cli = demo_pkg.cli:main\n"
    members[f"{info}/RECORD"] = "".join(f"{name},," + "\n" for name in members) + f"{info}/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, text in members.items():
            zf.writestr(name, text)
    return buf.getvalue()


@pytest.fixture
def venv(tmp_path):
    path = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = subprocess.run([str(path / "bin" / "python"), "-c", code],
                             check=True, capture_output=True, text=True).stdout.strip()
    return path, purelib


def test_a_new_wheel_replaces_the_old_one_and_its_files_are_not_writable_by_others(venv):
    path, purelib = venv
    old = wheel("1.0", {"demo_pkg/__init__.py": "VERSION = 1\n", "demo_pkg/gone.py": "",
                        "demo_pkg/cli.py": "def main():\n    print('cli 1')\n"})
    new = wheel("2.0", {"demo_pkg/__init__.py": "VERSION = 2\n",
                        "demo_pkg/cli.py": "def main():\n    print('cli 2')\n"})
    os.umask(0o000)  # the module must not depend on the caller's umask
    try:
        dflash_env_venv.install_wheel(str(path), purelib, old, "demo_pkg-1.0-py3-none-any.whl")
        os.umask(0o022)
        assert os.path.exists(os.path.join(purelib, "demo_pkg", "gone.py"))
        dflash_env_venv.install_wheel(str(path), purelib, new, "demo_pkg-2.0-py3-none-any.whl")
    finally:
        os.umask(0o022)
    # The old build's files and dist-info are gone; the new one imports and its script runs.
    assert not os.path.exists(os.path.join(purelib, "demo_pkg", "gone.py"))
    installed = sorted(e for e in os.listdir(purelib) if e.startswith("demo_pkg"))
    assert installed == ["demo_pkg", "demo_pkg-2.0.dist-info"]
    code = "import importlib.metadata as m, demo_pkg; print(m.version('demo-pkg'), demo_pkg.VERSION)"
    out = subprocess.run([str(path / "bin" / "python"), "-c", code], capture_output=True, text=True)
    assert out.stdout.split() == ["2.0", "2"]
    cli = subprocess.run([str(path / "bin" / "demo-cli")], capture_output=True, text=True)
    assert cli.stdout == "cli 2\n"
    for root, _dirs, files in os.walk(os.path.join(purelib, "demo_pkg")):
        for name in files:
            assert os.stat(os.path.join(root, name)).st_mode & 0o022 == 0, name


def test_a_wheel_with_a_path_outside_site_packages_is_refused(venv):
    path, purelib = venv
    with pytest.raises(ValueError, match="outside site-packages"):
        dflash_env_venv.install_wheel(str(path), purelib, wheel("1.0", {"../escape.py": ""}),
                                      "demo_pkg-1.0-py3-none-any.whl")
    assert not os.path.exists(os.path.join(os.path.dirname(purelib), "escape.py"))


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
    entries = [("run.sh", "#!/bin/sh\n", 0o777), ("dflash/a.py", "", 0o666)]
    dflash_release_tree.unpack(archive(entries), str(dest))
    assert oct(os.stat(dest / "run.sh").st_mode & 0o777) == oct(0o755)
    assert oct(os.stat(dest / "dflash" / "a.py").st_mode & 0o777) == oct(0o644)
    assert oct(os.stat(dest / "dflash").st_mode & 0o777) == oct(0o755)
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
