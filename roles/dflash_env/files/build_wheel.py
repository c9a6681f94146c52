#!/usr/bin/env python3
"""Build the project's wheel on the controller, once per source content (cached by hash).

Usage: build_wheel.py PROJECT_DIR CACHE_DIR
Prints JSON: {"wheel": path, "wheel_b64": path, "source_sha256": hex}. The hash covers
pyproject.toml and the packages' files, so an unchanged tree reuses the cached wheel and the
container sees no change. `wheel_b64` is the wheel in base64 (text a lookup can read): the role
hands it to its module in the task's arguments, so the wheel needs no file transfer of its own.
"""

import base64
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

PACKAGES = ("dflash", "pvesim")
# The controller's wheel cache (one directory per source hash): each use refreshes a build's mtime;
# beyond the KEEP_BUILDS most recently used, builds unused for KEEP_SECONDS are removed.
KEEP_BUILDS = 5
KEEP_SECONDS = 24 * 3600


def source_hash(project):
    digest = hashlib.sha256()
    paths = [os.path.join(project, "pyproject.toml")]
    for package in PACKAGES:
        for root, dirs, files in os.walk(os.path.join(project, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
            paths.extend(os.path.join(root, f) for f in files if not f.endswith((".pyc", ".pyo")))
    for path in sorted(paths):
        digest.update(os.path.relpath(path, project).encode() + b"\0")
        with open(path, "rb") as fh:
            digest.update(hashlib.sha256(fh.read()).digest())
    return digest.hexdigest()


def build(project, cache):
    sha = source_hash(project)
    target = os.path.join(cache, sha[:16])
    wheels = glob.glob(os.path.join(target, "*.whl"))
    if not wheels:
        os.makedirs(cache, exist_ok=True)
        work = tempfile.mkdtemp(dir=cache, prefix=".build-")
        try:
            subprocess.run(
                [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                 "--no-index", "-q", "-w", work, project],
                check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            )
            os.replace(work, target)
        except subprocess.CalledProcessError as exc:
            sys.exit(f"build_wheel: pip wheel {project} failed:\n{exc.stderr}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        wheels = glob.glob(os.path.join(target, "*.whl"))
    encoded = wheels[0] + ".b64"
    if not os.path.exists(encoded):
        with open(wheels[0], "rb") as fh:
            data = base64.b64encode(fh.read())
        tmp = f"{encoded}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, encoded)
    os.utime(target)  # used now: the newest build in the cache
    prune(cache)
    return {"wheel": wheels[0], "wheel_b64": encoded, "source_sha256": sha}


def prune(cache, keep=None, keep_seconds=None, now=None):
    """Remove the builds beyond the `keep` most recently used that were not used for `keep_seconds`
    (KEEP_BUILDS and KEEP_SECONDS by default; unfinished `.build-*` directories are left to their
    builder). Returns the removed directories."""
    keep = KEEP_BUILDS if keep is None else keep
    keep_seconds = KEEP_SECONDS if keep_seconds is None else keep_seconds
    now = time.time() if now is None else now
    builds = []
    for entry in os.scandir(cache):
        if entry.is_dir(follow_symlinks=False) and not entry.name.startswith("."):
            try:
                builds.append((entry.stat(follow_symlinks=False).st_mtime, entry.path))
            except FileNotFoundError:  # another deploy pruned it meanwhile
                continue
    removed = []
    for mtime, path in sorted(builds, reverse=True)[keep:]:
        if now - mtime >= keep_seconds:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def main(argv):
    if len(argv) != 3:
        sys.exit("usage: build_wheel.py PROJECT_DIR CACHE_DIR")
    project = os.path.abspath(argv[1])
    if not os.path.isfile(os.path.join(project, "pyproject.toml")):
        sys.exit(f"build_wheel: {project} has no pyproject.toml")
    print(json.dumps(build(project, os.path.abspath(argv[2]))))


if __name__ == "__main__":
    main(sys.argv)
