"""The one rule for every path the trainer writes (status.json, checkpoints, metrics, TensorBoard, an
export): never through a symbolic link, and only in directories this user owns.

A directory the run writes in must not be a symbolic link, must be owned by this user, and must sit in
a directory that is not a symbolic link, is this user's or root's, and is not writable by every user
(unless sticky, as /tmp); whoever could change any of them could have the run write where they chose.
Every directory above it is reached from / one name at a time (`walk`: O_NOFOLLOW and O_DIRECTORY per
name, relative to the directory before it) and must be root's or this user's, in a directory not
writable by every user unless sticky; a symbolic link on the way is followed only when it passes the same
test (root or this user put it there, as /var/run -> /run). A file is opened with O_NOFOLLOW inside its
directory's descriptor and checked on its own descriptor (a regular file of this user's), so what is
checked is what is written. The collection's modules keep the same rule for what they write and run
(ansible_collections/dflash/ops/plugins/module_utils/safe_paths.py): change both together.
`UnsafePath` says which path and why; `python -m dflash_ops.config validate` reports it as `run.output_dir`
before a deploy touches anything running.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class UnsafePath(ValueError):
    """`path` is not trusted; `reason` says why ('is a symbolic link (to /etc)')."""

    def __init__(self, path: str | Path, reason: str):
        super().__init__(f"{path} {reason}: the run writes nowhere another user (or a symbolic link) "
                         f"could have chosen; remove it or make it a directory of uid {os.geteuid()}")
        self.path, self.reason = str(path), reason


def _link(path: Path, kind: str) -> str:
    try:
        return f"is a symbolic link (to {os.readlink(path)}), not a {kind}"
    except OSError:
        return f"is a symbolic link, not a {kind}"


DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_LINKS = 40  # symbolic links followed on the way to one path at most (the kernel's own limit)


def holder_problem(entry: os.stat_result, holder: os.stat_result) -> str | None:
    """Why a directory (or a symbolic link) on the way, `entry` of directory `holder`, is not trusted."""
    if entry.st_uid not in (os.geteuid(), 0):
        return f"is owned by uid {entry.st_uid} (another user can replace what is in it)"
    if holder.st_mode & stat.S_IWOTH and not holder.st_mode & stat.S_ISVTX:
        return f"is in a directory every user can write to (mode {stat.S_IMODE(holder.st_mode):04o})"
    return None


def walk(path: str | Path) -> int:
    """A descriptor of the directory `path` reached from / one name at a time, each name opened with
    O_NOFOLLOW relative to the directory before it and trusted by holder_problem (a symbolic link on
    the way only then followed; `path` itself never a link); raises UnsafePath naming the name at fault
    (or FileNotFoundError)."""
    names = [name for name in os.path.abspath(path).split("/") if name]
    links, here = 0, "/"
    fd = os.open("/", DIRECTORY_FLAGS)
    try:
        while names:
            name = names.pop(0)
            current, holder = os.path.join(here, name), os.fstat(fd)
            try:
                child = os.open(name, DIRECTORY_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                info = os.lstat(name, dir_fd=fd)
                if not stat.S_ISLNK(info.st_mode):
                    raise UnsafePath(current, "is not a directory") from None
                target = os.readlink(name, dir_fd=fd)
                problem = "is the directory itself" if not names else holder_problem(info, holder)
                links += 1
                if problem or links > MAX_LINKS:
                    raise UnsafePath(current, f"is a symbolic link (to {target}), not a directory") from None
                names = [n for n in os.path.normpath(os.path.join(here, target)).split("/") if n] + names
                os.close(fd)
                fd, here = os.open("/", DIRECTORY_FLAGS), "/"
                continue
            os.close(fd)
            fd, here = child, current
            problem = holder_problem(os.fstat(fd), holder)
            if problem:
                raise UnsafePath(current, problem)
        return fd
    except BaseException:
        os.close(fd)
        raise


def directory_problem(path: str | Path) -> str | None:
    """Why the existing directory `path` must not be written in, or None."""
    path = Path(path)
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return _link(path, "directory")
    if not stat.S_ISDIR(info.st_mode):
        return "is not a directory"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by uid {os.geteuid()} that runs the trainer"
    parent = path.absolute().parent
    up = os.lstat(parent)
    if stat.S_ISLNK(up.st_mode):
        return f"is in {parent}, which {_link(parent, 'directory')}"
    if up.st_uid not in (os.geteuid(), 0):
        return f"is in {parent}, owned by uid {up.st_uid} (another user can replace what is in it)"
    if up.st_mode & stat.S_IWOTH and not up.st_mode & stat.S_ISVTX:
        return f"is in {parent}, which every user can write to (mode {stat.S_IMODE(up.st_mode):04o})"
    try:
        os.close(walk(path))
    except UnsafePath as exc:
        return f"is reached through {exc.path}, which {exc.reason}"
    return None


def check_directory(path: str | Path) -> Path:
    """`path`, once it is known to be a directory the run may write in; raises UnsafePath."""
    problem = directory_problem(path)
    if problem:
        raise UnsafePath(path, problem)
    return Path(path)


def output_dir_problem(output_dir: str | Path, subdirectories=()) -> str | None:
    """Why the run could not safely write in `output_dir` (or, while it does not exist, in the nearest
    directory above it that does, where the run would make it) or in the `subdirectories` of it that
    exist; None when it could. Nothing is created or changed."""
    existing = Path(output_dir).absolute()
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    for path in (existing, *(Path(output_dir) / name for name in subdirectories)):
        if os.path.lexists(path):
            problem = directory_problem(path)
            if problem:
                return f"{path} {problem}"
    return None


def open_file(path: str | Path, flags: int, mode: int) -> int:
    """A descriptor of `path` opened with `flags` (O_CREAT makes it with `mode`) inside its directory,
    reached by walk, never through a symbolic link, and only when it is a regular file of this user's;
    raises UnsafePath."""
    directory, name = os.path.split(os.path.abspath(path))
    dir_fd = walk(directory)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePath(path, _link(Path(path), "regular file")) from None
        raise
    finally:
        os.close(dir_fd)
    info = os.fstat(fd)
    problem = ("is not a regular file" if not stat.S_ISREG(info.st_mode)
               else f"is owned by uid {info.st_uid}" if info.st_uid != os.geteuid() else None)
    if problem:
        os.close(fd)
        raise UnsafePath(path, problem)
    return fd


def replace_file(directory: str | Path, name: str, write, mode: int = 0o600) -> Path:
    """Write `directory`/`name` through `write(binary file object)` into a temporary file of that
    directory, then rename it over the name: a symbolic link (or anything) planted at the name is
    replaced, never written through. The directory must pass check_directory (this user's, no link on
    the way); the file gets `mode`. Raises UnsafePath."""
    check_directory(directory)
    dir_fd = walk(directory)
    temporary = f".{name}.partial-{os.getpid()}"
    try:
        if os.fstat(dir_fd).st_uid != os.geteuid():  # the one checked is the one written in
            raise UnsafePath(directory, f"is owned by uid {os.fstat(dir_fd).st_uid}")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                     dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as handle:
                os.fchmod(handle.fileno(), mode)
                write(handle)
            os.rename(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(temporary, dir_fd=dir_fd)
            except OSError:
                pass
            raise
    finally:
        os.close(dir_fd)
    return Path(directory) / name
