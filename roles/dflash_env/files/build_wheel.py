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

PACKAGES = ("dflash", "pvesim")


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
    return {"wheel": wheels[0], "wheel_b64": encoded, "source_sha256": sha}


def main(argv):
    if len(argv) != 3:
        sys.exit("usage: build_wheel.py PROJECT_DIR CACHE_DIR")
    project = os.path.abspath(argv[1])
    if not os.path.isfile(os.path.join(project, "pyproject.toml")):
        sys.exit(f"build_wheel: {project} has no pyproject.toml")
    print(json.dumps(build(project, os.path.abspath(argv[2]))))


if __name__ == "__main__":
    main(sys.argv)
