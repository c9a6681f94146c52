# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What the controller takes from a container, on both sides, by safe_paths' rule.

In the container (the module, as root): a file of a run's output directory is read only when it is a
regular file of root's or the run's user's, not writable by others, reached from / one name at a time
without a symbolic link anywhere on the way (safe_paths.walk, the file opened O_NOFOLLOW inside its
directory's descriptor); a directory's files the same, its subdirectories too. A link, another user's file
or a device is refused by name and nothing of that container is taken.

On the controller (the action plugins, as the controller's user): the destination directory is made by
the play (0700) or, when it exists, used only when it is this user's, not a link, and neither its group
nor others may write to it; each file lands 0600 through a temporary file in that directory renamed over
the name, so a name planted there is replaced, never written through."""

from __future__ import annotations

import errno
import hashlib
import os
from stat import S_IMODE, S_ISDIR, S_ISLNK

from ansible_collections.dflash.ops.plugins.module_utils.safe_paths import (
    DIRECTORY_FLAGS,
    OTHERS_WRITE,
    UnsafePath,
    unsafe_reason,
    walk,
)

FILE_MODE, DIR_MODE = 0o600, 0o700
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _read_at(dir_fd, name, where, owner, max_bytes):
    """The bytes of regular file `name` in directory `dir_fd`, opened without following a link and
    trusted by unsafe_reason (root's or `owner`'s); raises UnsafePath naming `where`."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            target = os.readlink(name, dir_fd=dir_fd)
            raise UnsafePath(where, f"is a symbolic link (to {target}), not a regular file") from None
        raise
    with os.fdopen(fd, "rb") as handle:
        reason = unsafe_reason(os.fstat(fd), os.fstat(dir_fd), os.geteuid(), owner=owner)
        if reason:
            raise UnsafePath(where, reason)
        data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UnsafePath(where, f"is larger than {max_bytes} bytes, the most one fetch takes")
    return data


def _tree_at(dir_fd, where, prefix, owner, max_bytes, found):
    """Every regular file under directory `dir_fd` into `found` ({relative path: bytes})."""
    for name in sorted(os.listdir(dir_fd)):
        path, relative = f"{where}/{name}", f"{prefix}/{name}"
        info = os.lstat(name, dir_fd=dir_fd)
        if S_ISDIR(info.st_mode):
            try:
                child = os.open(name, DIRECTORY_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                raise UnsafePath(path, f"cannot be opened as a directory ({exc.strerror})") from None
            try:
                reason = unsafe_reason(os.fstat(child), os.fstat(dir_fd), os.geteuid(), directory=True,
                                       owner=owner)
                if reason:
                    raise UnsafePath(path, reason)
                _tree_at(child, path, relative, owner, max_bytes, found)
            finally:
                os.close(child)
        else:
            found[relative] = _read_at(dir_fd, name, path, owner, max_bytes)


def read_run_files(directory, paths, owner=None, max_bytes=1 << 28):
    """{path relative to `directory`: bytes} of each of `paths` (a file, or a directory: every file under
    it) that exists in `directory`, a run's output directory. `owner`: the uid of the run's user, whose
    files and directories are trusted as root's are. Raises UnsafePath (nothing read is returned) or
    OSError (FileNotFoundError: `directory` is missing)."""
    found = {}
    top = walk(directory, owner=owner)
    try:
        for relative in paths:
            names = [name for name in relative.split("/") if name not in ("", ".")]
            if not names or ".." in names:
                raise UnsafePath(relative, "is not a path inside the run's output directory")
            fd, where = os.dup(top), directory
            try:
                for name in names[:-1]:
                    where = f"{where}/{name}"
                    try:
                        child = os.open(name, DIRECTORY_FLAGS, dir_fd=fd)
                    except FileNotFoundError:
                        break
                    except OSError as exc:
                        raise UnsafePath(where, f"is not a directory that can be entered ({exc.strerror})") \
                            from None
                    holder = os.fstat(fd)
                    os.close(fd)
                    fd = child
                    reason = unsafe_reason(os.fstat(fd), holder, os.geteuid(), directory=True, owner=owner)
                    if reason:
                        raise UnsafePath(where, reason)
                else:
                    where = f"{where}/{names[-1]}"
                    try:
                        info = os.lstat(names[-1], dir_fd=fd)
                    except FileNotFoundError:
                        continue
                    if not S_ISDIR(info.st_mode):
                        found["/".join(names)] = _read_at(fd, names[-1], where, owner, max_bytes)
                        continue
                    child = os.open(names[-1], DIRECTORY_FLAGS, dir_fd=fd)
                    try:
                        reason = unsafe_reason(os.fstat(child), os.fstat(fd), os.geteuid(), directory=True,
                                               owner=owner)
                        if reason:
                            raise UnsafePath(where, reason)
                        _tree_at(child, where, "/".join(names), owner, max_bytes, found)
                    finally:
                        os.close(child)
            finally:
                os.close(fd)
    finally:
        os.close(top)
    return found


def sha256_bytes(data):
    return hashlib.sha256(data).hexdigest()


def _own_directory_reason(info):
    """Why a directory on the controller must not receive what is fetched, or None."""
    if S_ISLNK(info.st_mode):
        return "is a symbolic link"
    if not S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by uid {os.geteuid()} that fetches into it"
    if info.st_mode & OTHERS_WRITE:
        return f"is writable by its group or other users (mode {S_IMODE(info.st_mode):04o})"
    return None


def open_private_directory(path, create=True):
    """A descriptor of the controller's directory `path`: reached by walk (no link, no other user's
    directory on the way), made 0700 when missing (with `create`; its missing parents too), refused
    (UnsafePath) when it is another user's, a link, or writable by its group or others."""
    path = os.path.abspath(path)
    missing = []
    while True:
        try:
            fd = walk(path)
            break
        except FileNotFoundError:
            if not create or path == "/":
                raise
            path, name = os.path.split(path)
            missing.append(name)
    try:
        reason = _own_directory_reason(os.fstat(fd)) if not missing else None
        if reason:
            raise UnsafePath(path, reason)
        for name in reversed(missing):
            fd = _sub_directory(fd, path, name)
            path = os.path.join(path, name)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _sub_directory(fd, where, name):
    """The descriptor of directory `name` in `fd` (closed), made 0700 when missing, checked when not."""
    try:
        os.mkdir(name, DIR_MODE, dir_fd=fd)
    except FileExistsError:
        pass
    try:
        child = os.open(name, DIRECTORY_FLAGS, dir_fd=fd)
    except OSError as exc:
        raise UnsafePath(os.path.join(where, name), f"cannot be opened as a directory ({exc.strerror})") \
            from None
    finally:
        os.close(fd)
    reason = _own_directory_reason(os.fstat(child))
    if reason:
        os.close(child)
        raise UnsafePath(os.path.join(where, name), reason)
    return child


def write_private(directory, relative, data):
    """Write `data` to `directory`/`relative` on the controller (0600; its directories 0700, made when
    missing and checked when not) through a temporary file renamed over the name."""
    names = [name for name in relative.split("/") if name]
    if not names or any(name in (".", "..") for name in names):
        raise UnsafePath(relative, "is not a path inside the destination directory")
    fd, where = open_private_directory(directory), directory
    try:
        for name in names[:-1]:
            fd = _sub_directory(fd, where, name)
            where = os.path.join(where, name)
        temporary = f".{names[-1]}.partial-{os.getpid()}"
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         FILE_MODE, dir_fd=fd)
        try:
            with os.fdopen(handle, "wb") as out:
                os.fchmod(out.fileno(), FILE_MODE)
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.rename(temporary, names[-1], src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            try:
                os.unlink(temporary, dir_fd=fd)
            except OSError:
                pass
            raise
    finally:
        os.close(fd)


def _private_tree(fd, where, prefix, found):
    """{prefix/relative: sha256} of every file under the controller's directory `fd` into `found`."""
    for name in sorted(os.listdir(fd)):
        if name.startswith("."):  # a temporary file of a write that did not finish
            continue
        path = os.path.join(where, name)
        try:
            handle = os.open(name, READ_FLAGS, dir_fd=fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePath(path, "is a symbolic link") from None
            raise
        _private_entry(handle, path, f"{prefix}/{name}", found)


def _private_entry(handle, path, relative, found):
    """The controller's file or directory `handle` (closed) at `path` into `found` (_private_tree)."""
    info = os.fstat(handle)
    if S_ISDIR(info.st_mode):
        try:
            reason = _own_directory_reason(info)
            if reason:
                raise UnsafePath(path, reason)
            _private_tree(handle, path, relative, found)
        finally:
            os.close(handle)
        return
    with os.fdopen(handle, "rb") as fh:
        if info.st_uid != os.geteuid():
            raise UnsafePath(path, f"is owned by uid {info.st_uid}, not by uid {os.geteuid()}")
        found[relative] = sha256_bytes(fh.read())


def private_checksums(directory, relative):
    """{relative path under `directory`: sha256} of the controller's copy at `directory`/`relative` (a
    file, or a directory: every file under it), each opened without following a link, in directories
    open_private_directory trusts; {} while it is missing. Raises UnsafePath."""
    names = [name for name in relative.split("/") if name]
    try:
        fd = open_private_directory(directory, create=False)
    except FileNotFoundError:
        return {}
    found, where = {}, directory
    try:
        for name in names[:-1]:
            try:
                child = os.open(name, DIRECTORY_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                return {}
            os.close(fd)
            fd, where = child, os.path.join(where, name)
            reason = _own_directory_reason(os.fstat(fd))
            if reason:
                raise UnsafePath(where, reason)
        try:
            handle = os.open(names[-1], READ_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePath(os.path.join(where, names[-1]), "is a symbolic link") from None
            raise
        _private_entry(handle, os.path.join(where, names[-1]), "/".join(names), found)
    finally:
        os.close(fd)
    return found
