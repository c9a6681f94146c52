# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The files of an exported drafter, on either side: their sha256, and the names a copy accepts."""

from __future__ import annotations

import errno
import hashlib
import os

from ansible_collections.dflash.ops.plugins.module_utils.run_pidfile import is_plain_file_name
from ansible_collections.dflash.ops.plugins.module_utils.safe_paths import (
    UnsafePath,
    open_file,
    unsafe_reason,
    walk,
)

# The export's list of its files' sha256 (`sha256sum -c SHA256SUMS`), written last by dflash_ops.export.
MANIFEST = "SHA256SUMS"


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def directory_checksums(directory):
    """{name: sha256} of the files in `directory` (an entry that is no plain file: "not a file"); None
    when it does not exist."""
    if not os.path.lexists(directory):
        return None
    if os.path.islink(directory) or not os.path.isdir(directory):
        raise ValueError(f"{directory} exists and is not a directory")
    paths = {name: os.path.join(directory, name) for name in sorted(os.listdir(directory))}
    return {name: sha256_file(path) if os.path.isfile(path) and not os.path.islink(path) else "not a file"
            for name, path in paths.items()}


def manifest_checksums(text):
    """{name: sha256} that a SHA256SUMS text lists."""
    pairs = (line.split("  ", 1) for line in text.splitlines() if "  " in line)
    return {name: digest for digest, name in pairs}


def odd_names(names):
    """The names that are not plain file names in one directory (a copy refuses them)."""
    return sorted(name for name in names if not is_plain_file_name(name))


# What an export holds, and where the release that writes it keeps the code it copies (CODE_FILES and
# AUTO_MAP of dflash_ops.serve.export; tests/dflash/serve/test_export_trust.py keeps both sides the same).
CODE_FILES = {"modeling_dflash.py": "dflash_ops/model/modeling_dflash.py",
              "drafter.py": "dflash_ops/model/drafter.py"}
EXPORT_FILES = frozenset({"config.json", "model.safetensors", "README.md", MANIFEST, *CODE_FILES})
AUTO_MAP = {"AutoModel": "modeling_dflash.DFlashDraftModel"}


def _sha256_fd(fd):
    digest = hashlib.sha256()
    with os.fdopen(fd, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def trusted_checksums(directory):
    """{name: sha256} of every entry of `directory`, a directory of root's reached without a link on the
    way, each a regular file of root's that no other user may write, opened O_NOFOLLOW (safe_paths'
    rule); raises UnsafePath naming the first that is not."""
    dir_fd = walk(directory)
    try:
        found = {}
        for name in sorted(os.listdir(dir_fd)):
            path = os.path.join(directory, name)
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise UnsafePath(path, "is a symbolic link, not a regular file") from None
                raise
            reason = unsafe_reason(os.fstat(fd), os.fstat(dir_fd), os.geteuid())
            if reason:
                os.close(fd)
                raise UnsafePath(path, reason)
            found[name] = _sha256_fd(fd)
        return found
    finally:
        os.close(dir_fd)


def release_code_checksums(code_dir):
    """{export name: sha256} of the code a release at `code_dir` copies into its exports, each read by
    safe_paths' rule (root's, no link on the way)."""
    return {name: _sha256_fd(open_file(os.path.join(code_dir, relative)))
            for name, relative in CODE_FILES.items()}


def export_problems(files, code):
    """Why the controller must not take an export whose files have the sha256 `files`, made by a release
    whose code files have `code` (release_code_checksums): other files than an export's, or code that is
    not the release's. [] when none."""
    problems = [f"{name} is no file of an export" for name in sorted(set(files) - EXPORT_FILES)]
    problems += [f"{name} is missing" for name in sorted(EXPORT_FILES - set(files))]
    problems += [f"{name} (sha256 {files[name]}) is not the release's {CODE_FILES[name]} (sha256 {digest})"
                 for name, digest in sorted(code.items()) if name in files and files[name] != digest]
    return problems
