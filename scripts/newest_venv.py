"""Build the venvs that run the collection's controller side on the newer ansible-core lines.

    python3 scripts/newest_venv.py           # (make newest-venv) silent when built

ansible-core 2.20 and 2.21 need Python 3.12 or newer on the controller, and Debian 12 has 3.11; the
`ansible` 13 and 14 packages, which bundle community.proxmox 1.6 and 2.0, need them. So:

1. `~/.cache/dflash-ops/python3.13/` (the user's cache, shared by the machine's checkouts): Debian 13's own
   Python 3.13, built once from its source package. apt fetches the `python3.13` source package of trixie
   through a private apt state under `~/.cache/dflash-ops/python3.13-build/`
   (a `deb-src` line for trixie on the machine's own Debian mirror and keyring; the system's apt sources,
   lists and packages are left as they are, and no trixie binary package is installed). apt checks the
   files against the signed Sources index; upstream's orig tarball is configured with the bookworm
   toolchain and -dev packages (installed with apt where missing) and `make altinstall`-ed into the prefix.
   Several minutes on 2 cores, once.
2. One venv of that Python for each newer line (LINES): `.cache/ansible13-venv` (ansible 13: ansible-core
   2.20, community.proxmox 1.6.0) and `.cache/newest-venv` (ansible 14: ansible-core 2.21, community.proxmox
   2.0.0), with paramiko for the connection and pytest for community.proxmox's unit suite.

The tests stay in the pinned venv (.venv: its torch runs the containers' trainer, pvesim runs there); with
DFLASH_ANSIBLE_BIN naming one of these venvs' bin/, every Ansible program they start is that venv's
(pvesim.fleet.ANSIBLE_BIN; make test-newest).
"""

import argparse
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

# cached_venv beside it, also when the tests import this as scripts.newest_venv
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cached_venv  # noqa: E402

CACHE = cached_venv.REPO / ".cache"
# The interpreter is the same for every checkout of the machine: it is built once into the user's cache
# (each checkout's venvs of it stay in its .cache/), under a lock: two checkouts never build it at once.
SHARED = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-ops"
PREFIX = SHARED / "python3.13"
PYTHON = PREFIX / "bin" / "python3.13"
WORK = SHARED / "python3.13-build"
LOCK = SHARED / "python3.13.lock"
SOURCE_PACKAGE, SOURCE_SUITE = "python3.13", "trixie"
DEBIAN_KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
# What CPython's configure looks for to build the modules pip, paramiko (cryptography) and Ansible import.
BUILD_DEPS = ("gcc", "make", "pkg-config", "libssl-dev", "libffi-dev", "zlib1g-dev", "libbz2-dev",
              "liblzma-dev", "libsqlite3-dev", "libreadline-dev", "libncurses-dev", "uuid-dev")
# The modules a build without them would lack (configure only warns).
REQUIRED_MODULES = ("ssl", "ctypes", "zlib", "bz2", "lzma", "sqlite3", "readline", "uuid", "hashlib")

# The release lines tested beside the pinned venv's (pyproject.toml's dev extra: ansible 12.3, ansible-core
# 2.19, community.proxmox 1.4.0): venv -> what it installs, and what its `ansible` package brings.
COMMON = ("paramiko==5.1.*", "pytest==9.2.*", "pytest-xdist==3.8.*")
LINES = {
    "ansible13-venv": {"requirements": ("ansible==13.8.*", *COMMON),
                       "ansible_core": "2.20", "community_proxmox": "1.6.0"},
    "newest-venv": {"requirements": ("ansible==14.5.*", *COMMON),
                    "ansible_core": "2.21", "community_proxmox": "2.0.0"},
}
NEWEST = CACHE / "newest-venv"


def _log(msg):
    print(f"newest-venv: {msg}", flush=True)


def debian_mirror():
    """The URI and keyring of the machine's own Debian archive (its sources entry for this release's main)."""
    codename = re.search(r"^VERSION_CODENAME=(\w+)", Path("/etc/os-release").read_text(), re.M).group(1)
    stanzas = []
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        stanzas += [dict(re.findall(r"^([\w-]+):\s*(.*)$", block, re.M))
                    for block in re.split(r"\n\s*\n", path.read_text())]
    for entry in stanzas:
        if codename in entry.get("Suites", "").split() and "main" in entry.get("Components", "").split():
            return entry["URIs"].split()[0], entry.get("Signed-By", DEBIAN_KEYRING)
    one_line = Path("/etc/apt/sources.list")
    for line in one_line.read_text().splitlines() if one_line.exists() else []:
        m = re.match(rf"deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+{codename}\s.*\bmain\b", line)
        if m:
            return m.group(1), DEBIAN_KEYRING
    sys.exit(f"newest-venv: no Debian '{codename} main' entry in the apt sources to take the mirror from")


def _apt_options():
    apt = WORK / "apt"
    return ["-o", f"Dir::Etc::SourceList={apt / 'sources.list'}", "-o", "Dir::Etc::SourceParts=/dev/null",
            "-o", f"Dir::State::Lists={apt / 'lists'}", "-o", f"Dir::Cache={apt / 'cache'}",
            "-o", "APT::Sandbox::User=root", "-qq"]


def fetch_source():
    """Download the source package into WORK/src through the private apt state; its orig tarball."""
    uri, keyring = debian_mirror()
    apt = WORK / "apt"
    for sub in ("lists/partial", "cache/archives/partial"):
        (apt / sub).mkdir(parents=True, exist_ok=True)
    (apt / "sources.list").write_text(f"deb-src [signed-by={keyring}] {uri} {SOURCE_SUITE} main\n")
    subprocess.run(["apt-get", *_apt_options(), "update"], check=True)
    src = WORK / "src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir()
    subprocess.run(["apt-get", *_apt_options(), "source", "--download-only", SOURCE_PACKAGE], cwd=src,
                   check=True)
    (orig,) = src.glob(f"{SOURCE_PACKAGE}_*.orig.tar.xz")
    return orig


def install_build_deps():
    missing = [p for p in BUILD_DEPS
               if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
    if missing:
        _log(f"apt-get install {' '.join(missing)}")
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def _run_logged(argv, cwd, log):
    with open(log, "a") as fh:
        fh.write(f"$ {' '.join(argv)}\n")
        fh.flush()
        res = subprocess.run(argv, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT)
    if res.returncode != 0:
        sys.exit(f"newest-venv: {' '.join(argv)} failed (exit {res.returncode}); its output: {log}\n"
                 + "".join(Path(log).read_text().splitlines(True)[-30:]))


def build_python():
    """PREFIX with Debian's python3.13, unless a complete build is there (another checkout's included)."""
    SHARED.mkdir(parents=True, exist_ok=True)
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second checkout waits for the first one's build, then uses it
        _build_python()


def _build_python():
    stamp = PREFIX / cached_venv.COMPLETE
    if stamp.is_file() and PYTHON.exists():
        return
    _log(f"building Python from Debian {SOURCE_SUITE}'s {SOURCE_PACKAGE} source package -> {PREFIX}"
         " (minutes)")
    install_build_deps()
    orig = fetch_source()
    version = orig.name.split("_")[1].rsplit(".orig", 1)[0]
    tree = WORK / f"Python-{version}"
    shutil.rmtree(tree, ignore_errors=True)
    with tarfile.open(orig) as tar:
        tar.extractall(WORK, filter="data")
    shutil.rmtree(PREFIX, ignore_errors=True)
    log = WORK / "build.log"
    log.write_text("")
    _run_logged(["./configure", f"--prefix={PREFIX}", "--with-ensurepip=no"], tree, log)
    _run_logged(["make", f"-j{os.cpu_count() or 2}"], tree, log)
    _run_logged(["make", "altinstall"], tree, log)
    check = subprocess.run([str(PYTHON), "-c", f"import {', '.join(REQUIRED_MODULES)}, ensurepip"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        sys.exit(f"newest-venv: the built Python lacks a module (its -dev package?): {check.stderr}")
    shutil.rmtree(tree)  # the prefix is what stays; the source and its objects are not needed again
    shutil.rmtree(WORK / "src")
    stamp.write_text(f"{SOURCE_PACKAGE} {version} ({SOURCE_SUITE} source package)\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    build_python()
    for name, line in LINES.items():
        cached_venv.build(CACHE / name, line["requirements"], label=name, python=PYTHON)
    return 0


if __name__ == "__main__":
    sys.exit(main())
