"""The trainer's import name is the project's own: `dflash_ops`. PyPI's `dflash` (z-lab's DFlash inference
code, 0.1.0) is installed beside it by anyone who compares an export with the reference; both must import
from one environment. Offline, a wheel of the same top-level name stands for z-lab's (what a collision
needs is the name, not the code). The commands users type: `dflash-ops COMMAND` and `python -m
dflash_ops.X`."""

import base64
import hashlib
import shutil
import subprocess
import sys
import zipfile

from pvesim.fleet import REPO, VENV_BIN

ZLAB = "dflash"
MARKER = "z-lab's DFlash inference code (a stand-in of the same top-level name)"


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def zlab_wheel(dest):
    """A wheel of distribution `dflash` 0.1.0 whose top-level package is `dflash`, as PyPI's is."""
    files = {
        "dflash/__init__.py": f"MARKER = {MARKER!r}\n".encode(),
        "dflash-0.1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: dflash\nVersion: 0.1.0\n",
        "dflash-0.1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                        b"Tag: py3-none-any\n",
        "dflash-0.1.0.dist-info/top_level.txt": b"dflash\n",
    }
    path = dest / "dflash-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, data in files.items():
            whl.writestr(name, data)
        record = [record_line(name, data) for name, data in files.items()]
        whl.writestr("dflash-0.1.0.dist-info/RECORD", "\n".join([*record, "dflash-0.1.0.dist-info/RECORD,,"]))
    return path


def our_wheel(tmp_path):
    """dflash-ops built as pip builds it for an install, from a copy of what the package ships."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, src / name)
    for package in ("dflash_ops", "pvesim"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheels"
    subprocess.run([str(VENV_BIN / "python"), "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("dflash_ops-*.whl")
    return wheel


def test_ours_and_z_labs_dflash_install_into_one_environment_and_both_import(tmp_path):
    ours = our_wheel(tmp_path)
    with zipfile.ZipFile(ours) as whl:
        roots = {name.split("/")[0] for name in whl.namelist()}
    top_level = {root for root in roots if not root.endswith(".dist-info")}
    assert ZLAB not in top_level and "dflash_ops" in top_level, top_level
    env = tmp_path / "site"
    install = subprocess.run([str(VENV_BIN / "python"), "-m", "pip", "install", "-q", "--no-deps",
                              "--no-index", "--target", str(env), str(zlab_wheel(tmp_path)), str(ours)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0 and "already exists" not in install.stderr, install.stderr
    probe = ("import dflash, dflash_ops.core.config, dflash_ops.__main__ as m; "
             "print(dflash.MARKER); print(dflash_ops.__file__); print(sorted(m.COMMANDS))")
    # The target directory first: its dflash_ops, not the venv's editable one (asserted below).
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path[:0] = [{str(env)!r}]; {probe}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    marker, ours_file, commands = proc.stdout.splitlines()
    assert marker == MARKER
    assert ours_file.startswith(str(env)), ours_file
    assert "train" in commands and "export" in commands, commands


def test_the_console_script_lists_the_commands_and_runs_each_module_s_main():
    script = VENV_BIN / "dflash-ops"
    listing = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    for command in ("train", "config", "capture", "data", "evaluate", "export", "plots", "demo"):
        assert f"  {command} " in listing.stdout, listing.stdout
    reference = subprocess.run([str(script), "config", "reference"], capture_output=True, text=True,
                               timeout=120)
    module = subprocess.run([str(VENV_BIN / "python"), "-m", "dflash_ops.config", "reference"],
                            capture_output=True, text=True, timeout=120, cwd=REPO)
    assert reference.returncode == module.returncode == 0, reference.stderr + module.stderr
    assert reference.stdout == module.stdout and "\noptim:\n" in reference.stdout
    unknown = subprocess.run([str(script), "trian"], capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "unknown command 'trian'" in unknown.stderr, unknown.stderr
