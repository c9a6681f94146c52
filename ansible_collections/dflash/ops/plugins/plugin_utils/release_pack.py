# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A release packed on the controller: the trainer's code and a container's rendered files (config.yaml,
run.sh) plus REVISION, as one reproducible tar.gz archive and its base64 text.

The release id is a content hash of the code and the rendered files, so an unchanged tree and config give
the same id (and the container gets nothing new), and containers that render the same files share one
release: its archive is written once (the first packer wins; REVISION records when), so every container
of it gets the same bytes, whichever of the deploy's processes packed it first. The cache is trusted by
content, not by name: a cached archive is reused only when it holds exactly the files the id hashes (and
its base64 text only when it is that archive's), and is rebuilt otherwise, which the deploy says. The
base64 text rides in the arguments of the container's module call (`dflash_release_tree`, whose action
plugin packs), so the release needs no file transfer of its own.
"""

import base64
import datetime
import gzip
import hashlib
import io
import os
import tarfile
import time
import zlib

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
    """{"id", "archive", "archive_b64", "code_sha256", "files": {path in the release: sha256}} of the
    release of `code_dir` (a Python package) with the `rendered` files ({name: text}); the archive cache
    in `dest_dir` is pruned afterwards."""
    # The source's default is a checkout's dflash_ops/ next to playbooks/: a playbook run from an installed
    # collection has none there, and is told where the trainer's source is.
    if not os.path.isfile(os.path.join(code_dir, "__init__.py")):
        raise ValueError(f"{code_dir} is not a Python package (no __init__.py): set "
                         "dflash_release_source_dir to the dflash_ops/ directory of a dflash-ops checkout "
                         "(-e dflash_release_source_dir=/path/to/dflash-ops/dflash_ops)")
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
    encoded = f"{archive}.b64"
    rebuilt = []
    problem = archive_problem(archive, rid, blobs)
    if problem:
        if os.path.lexists(archive):
            rebuilt.append(f"{archive} {problem}")
        write_archive(archive, blobs, replace=os.path.lexists(archive))
    with open(archive, "rb") as fh:
        data = fh.read()
    if archive_problem(archive, rid, blobs, data=data):
        raise ValueError(f"{archive} changed while it was packed (another deploy, or someone else): "
                         "deploy again")
    text = base64.b64encode(data)
    problem = encoded_problem(encoded, text)
    if problem:
        if os.path.lexists(encoded):
            rebuilt.append(f"{encoded} {problem}")
        tmp = f"{encoded}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(text)
        os.replace(tmp, encoded)
    for path in (archive, encoded):
        os.utime(path)  # used now: the newest in the cache
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        checksums = {m.name: hashlib.sha256(tar.extractfile(m).read()).hexdigest()
                     for m in tar.getmembers() if m.isfile()}
    prune(dest_dir)
    # `content` is the verified text itself, never read again from the cache (which could change).
    return {"id": rid, "archive": archive, "archive_b64": encoded, "code_sha256": code_sha,
            "files": checksums, "content": text.decode(), "rebuilt": rebuilt}


def write_archive(archive, blobs, replace=False):
    """Write the archive of `blobs`; the first packer wins (every container of a release gets the same
    bytes, whichever of the deploy's processes packed it first) unless `replace` (a cached one that
    failed its check)."""
    tmp = f"{archive}.{os.getpid()}.tmp"
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w") as tar:
        for name in sorted(blobs):
            add(tar, name, blobs[name])
    try:
        if replace:
            os.replace(tmp, archive)
        else:
            os.link(tmp, archive)
    except FileExistsError:
        pass
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def revision_lines(data):
    """REVISION's lines but its `created:` one (when the archive was packed first)."""
    return [line for line in data.decode("utf-8", "replace").splitlines() if not line.startswith("created:")]


def archive_problem(archive, rid, blobs, data=None):
    """Why the cached `archive` (its bytes `data`, read when not given) is not release `rid` of `blobs`,
    or None: the cache is trusted by content, never by file name. It must hold exactly the release's
    files, each a plain file of root's with the mode `add` gives it and the content the id hashes, and
    its REVISION but the time it was packed."""
    try:
        if data is None:
            if os.path.islink(archive) or not os.path.isfile(archive):
                return "is not a regular file" if os.path.lexists(archive) else "is missing"
            with open(archive, "rb") as fh:
                data = fh.read()
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            members = tar.getmembers()
            if sorted(m.name for m in members) != sorted(blobs):
                return "does not hold the release's files"
            for member in members:
                mode = 0o755 if member.name in EXECUTABLE else 0o644
                if not member.isfile() or member.mode != mode or member.uid or member.gid:
                    return f"holds {member.name} as something else than the release's plain file"
                content = tar.extractfile(member).read()
                same = (revision_lines(content) == revision_lines(blobs[member.name])
                        if member.name == "REVISION" else content == blobs[member.name])
                if not same:
                    return f"holds a {member.name} whose content is not the release's (release id {rid})"
    except (OSError, EOFError, tarfile.TarError, zlib.error) as exc:
        return f"cannot be read as the release's archive ({exc})"
    return None


def encoded_problem(encoded, text):
    """Why the cached base64 text `encoded` is not `text` (the verified archive's), or None."""
    try:
        if os.path.islink(encoded):
            return "is a symbolic link"
        with open(encoded, "rb") as fh:
            cached = fh.read()
    except FileNotFoundError:
        return "is missing"
    except OSError as exc:
        return f"cannot be read ({exc})"
    return None if cached == text else "is not the base64 text of the release's archive"


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
