# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The files of an exported drafter, on either side: their sha256, and the names a copy accepts."""

from __future__ import annotations

import hashlib
import os

from ansible_collections.dflash.ops.plugins.module_utils.run_pidfile import is_plain_file_name

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
