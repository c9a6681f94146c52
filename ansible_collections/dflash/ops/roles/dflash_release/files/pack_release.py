"""Pack the releases of a batch of containers (the trainer's code, each one's rendered files and REVISION)
into tar.gz archives on the controller, in one process.

Usage: pack_release.py SOURCE_REVISION < {NAME: {"code_dir": dir, "dest_dir": dir, "exclude": [path, ...],
                                                 "files": {"config.yaml": text, "run.sh": text}}, ...}

NAME is a container's inventory name. The release id is a content hash of the code and the rendered
files, so an unchanged tree and config give the same id (and the container gets nothing new), and
containers that render the same files share one release: each distinct request is packed once. The
archive of an id is written once (REVISION records when), so every container of that release gets the
same bytes. Prints JSON {NAME: {"id": ..., "archive": path, "archive_b64": path, "code_sha256": ...,
"files": {path in the release: sha256}}}. `archive_b64` is the archive in base64 (text a lookup can
read): the role hands it to its module in the task's arguments, so the release needs no file transfer
of its own.
"""

import base64
import datetime
import gzip
import hashlib
import io
import json
import os
import sys
import tarfile
import time

SKIP_DIRS = {"__pycache__", ".pytest_cache", ".ruff_cache"}
# The controller's archive cache: each use refreshes an archive's mtime; beyond the KEEP_ARCHIVES most
# recently used, archives unused for KEEP_SECONDS are removed (a deploy running meanwhile keeps its own).
KEEP_ARCHIVES = 20
KEEP_SECONDS = 24 * 3600
SKIP_SUFFIXES = (".pyc", ".pyo")
EXECUTABLE = {"run.sh"}


def code_files(code_dir, exclude=()):
    """(path in the release, path on disk) of the code to ship, sorted; `exclude` names files (paths
    relative to code_dir) that never ship, such as the demo's asset builder."""
    prefix = os.path.basename(os.path.normpath(code_dir))
    found = []
    for root, dirs, files in os.walk(code_dir):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for name in files:
            path = os.path.join(root, name)
            if (not name.endswith(SKIP_SUFFIXES) and not name.startswith(".")
                    and os.path.relpath(path, code_dir) not in exclude):
                found.append((f"{prefix}/{os.path.relpath(path, code_dir)}", path))
    return sorted(found)


def release_id(checksums):
    """12 hex digits naming the release: a hash over every file's name and content hash."""
    digest = hashlib.sha256()
    for name in sorted(checksums):
        digest.update(f"{name}\0{checksums[name]}\n".encode())
    return digest.hexdigest()[:12]


def add(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o755 if name in EXECUTABLE else 0o644
    info.mtime = 0
    info.uname = info.gname = "root"
    tar.addfile(info, io.BytesIO(data))


def pack(code_dir, dest_dir, revision, rendered, exclude=()):
    blobs = {}
    for name, path in code_files(code_dir, exclude):
        with open(path, "rb") as fh:
            blobs[name] = fh.read()
    code_sha = release_id({n: hashlib.sha256(b).hexdigest() for n, b in blobs.items()})
    blobs.update({name: text.encode() for name, text in rendered.items()})
    checksums = {name: hashlib.sha256(data).hexdigest() for name, data in blobs.items()}
    rid = release_id(checksums)
    blobs["REVISION"] = (
        f"release: {rid}\nsource: {revision}\ncode: {code_sha}\n"
        f"config_sha256: {checksums.get('config.yaml', '-')}\n"
        f"created: {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')}\n"
    ).encode()
    os.makedirs(dest_dir, exist_ok=True)
    archive = os.path.join(dest_dir, f"{rid}.tar.gz")
    if not os.path.exists(archive):
        tmp = f"{archive}.{os.getpid()}.tmp"
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, \
                tarfile.open(fileobj=gz, mode="w") as tar:
            for name in sorted(blobs):
                add(tar, name, blobs[name])
        try:
            os.link(tmp, archive)  # first packer wins: every container of a release gets the same bytes
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    encoded = f"{archive}.b64"
    if not os.path.exists(encoded):
        with open(archive, "rb") as fh:
            data = base64.b64encode(fh.read())
        tmp = f"{encoded}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, encoded)
    for path in (archive, encoded):
        os.utime(path)  # used now: the newest in the cache
    with tarfile.open(archive) as tar:
        checksums = {m.name: hashlib.sha256(tar.extractfile(m).read()).hexdigest()
                     for m in tar.getmembers() if m.isfile()}
    return {"id": rid, "archive": archive, "archive_b64": encoded, "code_sha256": code_sha,
            "files": checksums}


def prune(dest_dir, keep=None, keep_seconds=None, now=None):
    """Remove the archives (with their .b64) beyond the `keep` most recently used that were not used
    for `keep_seconds` (KEEP_ARCHIVES and KEEP_SECONDS by default). Returns the removed release ids."""
    keep = KEEP_ARCHIVES if keep is None else keep
    keep_seconds = KEEP_SECONDS if keep_seconds is None else keep_seconds
    now = time.time() if now is None else now
    archives = []
    for name in os.listdir(dest_dir):
        if name.endswith(".tar.gz"):
            try:
                archives.append((os.stat(os.path.join(dest_dir, name)).st_mtime, name))
            except FileNotFoundError:  # another deploy pruned it meanwhile
                continue
    removed = []
    for mtime, name in sorted(archives, reverse=True)[keep:]:
        if now - mtime < keep_seconds:
            continue
        for path in (os.path.join(dest_dir, name), os.path.join(dest_dir, name + ".b64")):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        removed.append(name.removesuffix(".tar.gz"))
    return removed


def pack_all(revision, requests):
    """{name: pack()'s result} for every request; requests that are the same are packed once."""
    packed, out = {}, {}
    for name, request in requests.items():
        key = json.dumps(request, sort_keys=True)
        if key not in packed:
            code_dir = request["code_dir"]
            if not os.path.isfile(os.path.join(code_dir, "__init__.py")):
                sys.exit(f"pack_release: {code_dir} is not a Python package (no __init__.py)")
            packed[key] = pack(code_dir, request["dest_dir"], revision, request["files"],
                               request.get("exclude", ()))
        out[name] = packed[key]
    for dest_dir in sorted({request["dest_dir"] for request in requests.values()}):
        prune(dest_dir)
    return out


def main(argv):
    if len(argv) != 2:
        sys.exit("usage: pack_release.py SOURCE_REVISION < requests.json")
    print(json.dumps(pack_all(argv[1] or "unknown", json.load(sys.stdin))))


if __name__ == "__main__":
    main(sys.argv)
