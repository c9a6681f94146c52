#!/usr/bin/env python3
"""Pack a source tree into a reproducible tar.gz named by its content hash (runs on the controller).

Usage: pack_source.py SRC_DIR DEST_DIR
Prints JSON: {"archive": path, "sha256": hex, "files": {relative path: sha256}}.
The same tree always gives the same bytes (sorted entries, fixed mtime/owner/mode), so the hash
says whether the code changed.
"""

import gzip
import hashlib
import io
import json
import os
import sys
import tarfile

SKIP_DIRS = {"__pycache__", ".pytest_cache", ".ruff_cache"}
SKIP_SUFFIXES = (".pyc", ".pyo")


def source_files(src):
    """Relative paths of the files to ship, sorted."""
    found = []
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for name in files:
            if name.endswith(SKIP_SUFFIXES) or name.startswith("."):
                continue
            found.append(os.path.relpath(os.path.join(root, name), src))
    return sorted(found)


def pack(src, dest_dir):
    prefix = os.path.basename(os.path.normpath(src))
    buf = io.BytesIO()
    checksums = {}
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for rel in source_files(src):
            path = os.path.join(src, rel)
            with open(path, "rb") as fh:
                data = fh.read()
            arcname = f"{prefix}/{rel}"
            checksums[arcname] = hashlib.sha256(data).hexdigest()
            info = tarfile.TarInfo(arcname)
            info.size = len(data)
            info.mode = 0o755 if os.access(path, os.X_OK) else 0o644
            info.mtime = 0
            info.uname = info.gname = "root"
            tar.addfile(info, io.BytesIO(data))
    blob = buf.getvalue()
    digest = hashlib.sha256(blob).hexdigest()
    os.makedirs(dest_dir, exist_ok=True)
    archive = os.path.join(dest_dir, f"{prefix}-{digest[:16]}.tar.gz")
    if not os.path.exists(archive):
        tmp = f"{archive}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(blob)
        os.replace(tmp, archive)
    return {"archive": archive, "sha256": digest, "files": checksums}


def main(argv):
    if len(argv) != 3:
        sys.exit("usage: pack_source.py SRC_DIR DEST_DIR")
    src, dest = argv[1], argv[2]
    if not os.path.isfile(os.path.join(src, "__init__.py")):
        sys.exit(f"pack_source: {src} is not a Python package (no __init__.py)")
    print(json.dumps(pack(src, dest)))


if __name__ == "__main__":
    main(sys.argv)
