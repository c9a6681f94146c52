# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one rule for every path a module writes or reads for a run (the pidfile and its lock, the log,
the secrets file, the release tree): a path is used only when neither it nor its directory is a
symbolic link, it has the expected type, this user owns it and no other user can write it, and its
directory is this user's or root's and not writable by every user (unless sticky, as /tmp).

Files are opened with O_NOFOLLOW inside their directory, itself opened with O_NOFOLLOW, and checked
on the open descriptor: what is checked is what is written, even if the path changes meanwhile."""

from __future__ import annotations

import errno
import os
from stat import S_IMODE, S_ISDIR, S_ISLNK, S_ISREG, S_ISVTX

OTHERS_WRITE = 0o022


class UnsafePath(Exception):
    """`path` is not trusted, and `reason` says why ('is a symbolic link (to /etc/passwd)')."""

    def __init__(self, path, reason):
        super().__init__(f"{path} {reason}")
        self.path, self.reason = path, reason


def unsafe_reason(file_stat, dir_stat, euid, directory=False, private=False):
    """Why a file (a directory with `directory`) and its containing directory must not be trusted, or
    None. `private`: readable by its owner alone as well (a secrets file)."""
    kind = "directory" if directory else "regular file"
    if S_ISLNK(file_stat.st_mode):
        return f"is a symbolic link, not a {kind}"
    if not (S_ISDIR if directory else S_ISREG)(file_stat.st_mode):
        return f"is not a {kind}"
    if file_stat.st_uid != euid:
        return f"is owned by uid {file_stat.st_uid}, not by uid {euid} that runs this module"
    mode = S_IMODE(file_stat.st_mode)
    if private and mode & 0o077:
        return f"is readable or writable by other users (mode {mode:04o})"
    if mode & OTHERS_WRITE:
        return f"is writable by other users (mode {mode:04o})"
    return directory_reason(dir_stat, euid)


def directory_reason(dir_stat, euid):
    """Why a directory must not hold files this module trusts, or None."""
    if dir_stat.st_uid not in (euid, 0):
        return f"is in a directory owned by uid {dir_stat.st_uid} (another user can replace what is in it)"
    if dir_stat.st_mode & 0o002 and not dir_stat.st_mode & S_ISVTX:
        return f"is in a directory every user can write to (mode {S_IMODE(dir_stat.st_mode):04o})"
    return None


def _link_reason(path, kind="regular file"):
    try:
        return f"is a symbolic link (to {os.readlink(path)}), not a {kind}"
    except OSError:
        return f"is a symbolic link, not a {kind}"


def open_directory(path):
    """A descriptor of directory `path`, which must not be a symbolic link; raises UnsafePath."""
    try:
        return os.open(path or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise UnsafePath(path, _link_reason(path, "directory")) from None
        if exc.errno == errno.ENOTDIR:
            raise UnsafePath(path, "is not a directory") from None
        raise


def open_file(path, flags=os.O_RDONLY, mode=0o644, private=False):
    """A descriptor of `path` opened with `flags` (O_CREAT creates it with `mode`), never through a
    symbolic link and only when unsafe_reason finds nothing; raises UnsafePath (or OSError)."""
    directory, name = os.path.split(path)
    try:
        dir_fd = open_directory(directory)
    except UnsafePath as exc:
        raise UnsafePath(path, f"is in {directory}, which {exc.reason}") from None
    try:
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePath(path, _link_reason(path)) from None
            raise
        reason = unsafe_reason(os.fstat(fd), os.fstat(dir_fd), os.geteuid(), private=private)
        if reason:
            os.close(fd)
            raise UnsafePath(path, reason)
        return fd
    finally:
        os.close(dir_fd)


def path_problem(path, directory=False):
    """Why the existing `path` (a directory with `directory`) or its directory is not trusted, or None
    when both are, or when `path` does not exist yet (nothing is created or changed)."""
    parent = os.path.dirname(path) or "."
    try:
        dir_stat = os.lstat(parent)
    except FileNotFoundError:
        return None
    if S_ISLNK(dir_stat.st_mode):
        return f"is in {parent}, which {_link_reason(parent, 'directory')}"
    try:
        file_stat = os.lstat(path)
    except FileNotFoundError:
        return directory_reason(dir_stat, os.geteuid())
    if S_ISLNK(file_stat.st_mode):
        return _link_reason(path, "directory" if directory else "regular file")
    return unsafe_reason(file_stat, dir_stat, os.geteuid(), directory=directory)


def refusal(what, path, reason, consequence):
    """The message of a refused path, in the pidfile's words: what it is, why, what was not done, the fix."""
    kind = "directory" if what.endswith("directory") else "file"
    return (f"{what} {path} {reason}: whoever made it so could have this write or read a file of their "
            f"choosing, so it is not trusted and {consequence}. Check who changed it, then remove it (or "
            f"make it a {kind} owned by uid {os.geteuid()}, not a symbolic link, and not writable by "
            f"others: chmod go-w).")
