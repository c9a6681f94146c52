# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The one rule for every path a module writes, reads or runs for a run (the pidfile and its lock, the
log, the secrets file, the release tree, run.sh and the interpreter it execs); the trainer keeps the same
rule for what it writes (dflash_ops/core/safe_paths.py: change both together).

- Every path is reached from / one name at a time (`walk`): each directory is opened with O_NOFOLLOW
  and O_DIRECTORY relative to the one before it (openat) and checked on its descriptor, so no name on
  the way can be swapped between the check and the use. Each directory on the way must be root's or
  this user's, in a directory no other user may write to (unless sticky, as /tmp, where only the
  owner of an entry may replace it).
- A symbolic link on the way is followed only when it passes the same test (root or this user put it
  there, as /var/run -> /run); one in a directory another user could write is refused.
- The file's own directory is never a symbolic link, nor is a file written or read (O_NOFOLLOW on the
  last name); the file has the expected type, this user owns it and no other user can write it.
- What runs as this user (run.sh, the release it is in, the interpreter it execs: `program_problem`)
  must in addition not be writable by its group, nor any directory on its way; so must what a venv's
  interpreter reads at its start (`venv_problem`: its pyvenv.cfg, its site-packages, each entry in them -
  the .pth files `site` runs - and each directory a .pth file adds to the path).
- What a run that runs as another user writes or is given (its status.json in its output directory, its
  secrets file) is read with that user as `owner`: its files and directories count as this user's.

What is checked is what is used: the file is opened inside its directory's descriptor and checked on
its own descriptor, even if the path changes meanwhile."""

from __future__ import annotations

import errno
import glob
import os
from stat import S_IMODE, S_ISDIR, S_ISLNK, S_ISREG, S_ISVTX

OTHERS_WRITE = 0o022


class UnsafePath(Exception):
    """`path` is not trusted, and `reason` says why ('is a symbolic link (to /etc/passwd)')."""

    def __init__(self, path, reason):
        super().__init__(f"{path} {reason}")
        self.path, self.reason = path, reason


def unsafe_reason(file_stat, dir_stat, euid, directory=False, private=False, owner=None):
    """Why a file (a directory with `directory`) and its containing directory must not be trusted, or
    None. `private`: readable by its owner alone as well (a secrets file). `owner`: the uid of the run's
    user, whose file it may be as well (its directory: root's, this user's or that user's)."""
    kind = "directory" if directory else "regular file"
    if S_ISLNK(file_stat.st_mode):
        return f"is a symbolic link, not a {kind}"
    if not (S_ISDIR if directory else S_ISREG)(file_stat.st_mode):
        return f"is not a {kind}"
    if file_stat.st_uid not in (euid, owner):
        also = f" or uid {owner} that the run runs as" if owner is not None else ""
        expected = f"uid {euid} that runs this module{also}"
        return f"is owned by uid {file_stat.st_uid}, not by {expected}"
    mode = S_IMODE(file_stat.st_mode)
    if private and mode & 0o077:
        return f"is readable or writable by other users (mode {mode:04o})"
    if mode & OTHERS_WRITE:
        return f"is writable by other users (mode {mode:04o})"
    return directory_reason(dir_stat, euid, owner=owner)


def directory_reason(dir_stat, euid, group_too=False, owner=None):
    """Why a directory must not hold files this module trusts, or None. `group_too`: a group that may
    write to it counts as other users (what runs as root). `owner`: a user whose directories are trusted
    as well (the run's user, for what it writes)."""
    if dir_stat.st_uid not in (euid, 0, owner):
        return f"is in a directory owned by uid {dir_stat.st_uid} (another user can replace what is in it)"
    writers = OTHERS_WRITE if group_too else 0o002
    if dir_stat.st_mode & writers and not dir_stat.st_mode & S_ISVTX:
        who = "other users" if group_too else "every user"
        return f"is in a directory {who} can write to (mode {S_IMODE(dir_stat.st_mode):04o})"
    return None


def entry_reason(entry_stat, dir_stat, euid, group_too=False, owner=None):
    """Why a directory or a symbolic link on the way to a path must not be passed through, or None."""
    if entry_stat.st_uid not in (euid, 0, owner):
        return f"is owned by uid {entry_stat.st_uid} (that user can replace what is in it)"
    return directory_reason(dir_stat, euid, group_too, owner)


def _link_reason(path, kind="regular file"):
    try:
        return f"is a symbolic link (to {os.readlink(path)}), not a {kind}"
    except OSError:
        return f"is a symbolic link, not a {kind}"


DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Symbolic links followed on the way to one path at most (the kernel's own limit).
MAX_LINKS = 40


def walk(path, follow_last=False, group_too=False, kind="directory", owner=None):
    """A descriptor of `path` reached from / one name at a time: each directory opened with O_NOFOLLOW
    relative to the one before it and checked by entry_reason on its descriptor; a symbolic link on the
    way followed only when entry_reason finds nothing against it; the last name opened as a directory
    (a regular file, opened read-only, with `kind` 'regular file'), never through a symbolic link unless
    `follow_last`. `owner`: a user whose directories and links are trusted too (entry_reason). Raises
    UnsafePath naming the name at fault (or OSError: FileNotFoundError)."""
    euid = os.geteuid()
    names = [name for name in os.path.abspath(path or ".").split("/") if name]
    links = 0
    fd = os.open("/", DIRECTORY_FLAGS)
    here = "/"
    try:
        while names:
            name = names.pop(0)
            last = not names
            flags = DIRECTORY_FLAGS if not last or kind == "directory" else \
                os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            current = os.path.join(here, name)
            holder = os.fstat(fd)
            try:
                child = os.open(name, flags, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                info = os.lstat(name, dir_fd=fd)
                if not S_ISLNK(info.st_mode):
                    raise UnsafePath(current, "is not a directory") from None
                target = os.readlink(name, dir_fd=fd)
                if last and not follow_last:
                    raise UnsafePath(current, f"is a symbolic link (to {target}), not a {kind}") from None
                reason = entry_reason(info, holder, euid, group_too, owner)
                links += 1
                if reason or links > MAX_LINKS:
                    raise UnsafePath(current, f"is a symbolic link (to {target}) that is not trusted: it "
                                              f"{reason or 'is one of too many links on the way'}") from None
                names = [n for n in os.path.normpath(os.path.join(here, target)).split("/") if n] + names
                os.close(fd)
                fd, here = os.open("/", DIRECTORY_FLAGS), "/"
                continue
            os.close(fd)
            fd, here = child, current
            reason = entry_reason(os.fstat(fd), holder, euid, group_too, owner) \
                if not last or kind == "directory" else directory_reason(holder, euid, group_too, owner)
            if reason:
                raise UnsafePath(current, reason)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_directory(path, owner=None):
    """A descriptor of directory `path` (walk): `path` must not be a symbolic link and every directory
    on the way to it must be trusted; raises UnsafePath."""
    return walk(path, owner=owner)


def _in_directory(path, directory, exc):
    """The reason of `path` when the walk to its `directory` refused `exc.path`."""
    if os.path.abspath(exc.path) == os.path.abspath(directory or "."):
        return f"is in {directory}, which {exc.reason}"
    return f"is in {directory}, and {exc.path} on the way to it {exc.reason}"


def open_file(path, flags=os.O_RDONLY, mode=0o644, private=False, owner=None):
    """A descriptor of `path` opened with `flags` (O_CREAT creates it with `mode`) inside its directory,
    reached by walk, never through a symbolic link and only when unsafe_reason finds nothing; raises
    UnsafePath (or OSError). `owner`: the run's user's uid, whose file and directories are trusted too
    (what a run as that user writes, read back)."""
    directory, name = os.path.split(path)
    try:
        dir_fd = open_directory(directory, owner)
    except UnsafePath as exc:
        raise UnsafePath(path, _in_directory(path, directory, exc)) from None
    try:
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafePath(path, _link_reason(path)) from None
            raise
        reason = unsafe_reason(os.fstat(fd), os.fstat(dir_fd), os.geteuid(), private=private, owner=owner)
        if reason:
            os.close(fd)
            raise UnsafePath(path, reason)
        return fd
    finally:
        os.close(dir_fd)


def path_problem(path, directory=False):
    """Why the existing `path` (a directory with `directory`) or a directory on the way to it is not
    trusted, or None when all are, or when its directory does not exist yet (nothing is created or
    changed)."""
    parent = os.path.dirname(path) or "."
    try:
        dir_fd = open_directory(parent)
    except FileNotFoundError:
        return None
    except UnsafePath as exc:
        return _in_directory(path, parent, exc)
    try:
        dir_stat = os.fstat(dir_fd)
        try:
            file_stat = os.lstat(os.path.basename(path), dir_fd=dir_fd)
        except FileNotFoundError:
            return directory_reason(dir_stat, os.geteuid())
    finally:
        os.close(dir_fd)
    if S_ISLNK(file_stat.st_mode):
        return _link_reason(path, "directory" if directory else "regular file")
    return unsafe_reason(file_stat, dir_stat, os.geteuid(), directory=directory)


def program_problem(path):
    """Why what runs as this user, `path` (run.sh, the interpreter it execs), must not be run, or None:
    walked from / (symbolic links followed only where trusted, as exec follows them), it must be a
    regular file of this user's (root's) that neither its group nor other users can write, nor any
    directory on its way. Nothing is run or changed."""
    try:
        fd = walk(path, follow_last=True, group_too=True, kind="regular file")
    except UnsafePath as exc:
        return exc.reason if os.path.abspath(exc.path) == os.path.abspath(path) else \
            f"is reached through {exc.path}, which {exc.reason}"
    except FileNotFoundError:
        return "does not exist"
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    return program_stat_reason(info)


def program_stat_reason(info):
    """Why a file (or directory) of what runs as this user must not be trusted, by its stat, or None."""
    if not (S_ISREG(info.st_mode) or S_ISDIR(info.st_mode)):
        return "is not a regular file"
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not by uid {os.geteuid()} that runs it"
    if info.st_mode & OTHERS_WRITE:
        return f"is writable by its group or other users (mode {S_IMODE(info.st_mode):04o})"
    return None


VENV_CONFIG = "pyvenv.cfg"


def _walked_problem(path, kind="directory"):
    """Why `path`, walked as program_problem walks (links followed where trusted, every directory on the way
    root's and writable by it alone), must not be trusted, as the words that name it; with its descriptor."""
    try:
        fd = walk(path, follow_last=True, group_too=True, kind=kind)
    except UnsafePath as exc:
        same = os.path.abspath(exc.path) == os.path.abspath(path)
        if same:
            return f"{path} {exc.reason}", None
        return f"{path} is reached through {exc.path}, which {exc.reason}", None
    reason = program_stat_reason(os.fstat(fd))
    if reason:
        os.close(fd)
        return f"{path} {reason}", None
    return None, fd


def _site_entries_problem(site, fd):
    """Why an entry directly in the site directory `site` (descriptor `fd`) must not be trusted: a .pth
    file (`site` runs its import lines and puts the directories it names on the path, each walked too), a
    package or module root imports; or None. Deeper files are the pip of root's that made them."""
    added = []
    for name in sorted(os.listdir(fd)):
        info = os.lstat(name, dir_fd=fd)
        reason = "is a symbolic link" if S_ISLNK(info.st_mode) else program_stat_reason(info)
        if reason:
            return f"{os.path.join(site, name)} {reason}"
        if name.endswith(".pth") and S_ISREG(info.st_mode):
            added += _pth_directories(site, name, fd)
    for directory in added:
        if os.path.isdir(directory):
            problem, dir_fd = _walked_problem(directory)
            if problem:
                return f"{problem} (a directory a .pth file of {site} puts on the path)"
            os.close(dir_fd)
    return None


def _pth_directories(site, name, fd):
    """The directories the .pth file `name` of the site directory `site` (descriptor `fd`) names, as `site`
    reads it: each line but comments and import lines, relative to `site`."""
    pth = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    with os.fdopen(pth, encoding="utf-8", errors="replace") as lines:
        return [os.path.join(site, line.rstrip()) for line in lines if line.strip() and not
                line.startswith(("#", "import ", "import\t"))]


def _venv_prefix(python):
    """The venv directory of the interpreter `python` (where its pyvenv.cfg is), or None."""
    bin_dir = os.path.dirname(os.path.abspath(python))
    return next((d for d in (bin_dir, os.path.dirname(bin_dir))
                 if os.path.lexists(os.path.join(d, VENV_CONFIG))), None)


def venv_import_directories(python):
    """The directories the venv interpreter `python` imports from that its venv decides: each site-packages
    and each existing directory its .pth files name ([] for an interpreter that is not a venv's). Python
    drops a path entry it cannot read in silence, so a run's user who cannot read one of them fails at its
    first import; the start checks them for that user (run_start.reach_refusal) after venv_problem has
    judged them."""
    prefix = _venv_prefix(python)
    if prefix is None:
        return []
    found = []
    for site in sorted(glob.glob(os.path.join(glob.escape(prefix), "lib*", "python*", "site-packages"))):
        found.append(site)
        try:
            fd = os.open(site, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            found += [d for name in sorted(os.listdir(fd)) if name.endswith(".pth")
                      and S_ISREG(os.lstat(name, dir_fd=fd).st_mode)
                      for d in _pth_directories(site, name, fd) if os.path.isdir(d)]
        finally:
            os.close(fd)
    return list(dict.fromkeys(found))


def venv_problem(python):
    """Why what the venv interpreter `python` reads at its start must not be run as this user, or None:
    its pyvenv.cfg (where Python's getpath looks: the interpreter's directory or the one above), every
    site-packages of the venv (lib*/python*/site-packages) and each entry directly in them (site runs the
    import lines of each .pth file before the run's first line, and imports its packages from there), and
    each directory a .pth file names, all root's and writable by root alone, as every directory on the way
    (walked from /). A venv that includes the system's site-packages is refused: those are not checked.
    An interpreter without a pyvenv.cfg is not a venv's: program_problem alone judges it."""
    prefix = _venv_prefix(python)
    if prefix is None:
        return None
    config = os.path.join(prefix, VENV_CONFIG)
    problem, fd = _walked_problem(config, kind="regular file")
    if problem:
        return f"its venv's {problem}"
    with os.fdopen(fd, encoding="utf-8", errors="replace") as cfg:
        settings = {key.strip().lower(): value.strip().lower() for key, sep, value in
                    (line.partition("=") for line in cfg) if sep}
    if settings.get("include-system-site-packages") == "true":
        return (f"its venv's {config} includes the system's site-packages (include-system-site-packages = "
                f"true), which this start does not check: make the venv without --system-site-packages")
    seen = set()
    for site in sorted(glob.glob(os.path.join(glob.escape(prefix), "lib*", "python*", "site-packages"))):
        problem, fd = _walked_problem(site)
        if problem:
            return f"its venv's site-packages {problem}"
        try:
            info = os.fstat(fd)
            if (info.st_dev, info.st_ino) in seen:  # lib64 -> lib
                continue
            seen.add((info.st_dev, info.st_ino))
            problem = _site_entries_problem(site, fd)
        finally:
            os.close(fd)
        if problem:
            return f"its venv's site-packages: {problem}"
    return None


def tree_problem(directory):
    """Why the tree of `directory` (a release: run.sh, the code it imports), which runs as this user,
    must not be run, or None: the directory as program_problem judges a file, every file and directory
    in it as well, and no symbolic link in it. Nothing is run or changed."""
    try:
        top = walk(directory, group_too=True)
    except UnsafePath as exc:
        return f"{exc.path} {exc.reason}"
    try:
        reason = program_stat_reason(os.fstat(top))
        if reason:
            return f"{directory} {reason}"
        for root, dirs, files, root_fd in os.fwalk(".", dir_fd=top):
            for name in dirs + files:
                info = os.lstat(name, dir_fd=root_fd)
                where = os.path.normpath(os.path.join(directory, root, name))
                reason = "is a symbolic link" if S_ISLNK(info.st_mode) else program_stat_reason(info)
                if reason:
                    return f"{where} {reason}"
    finally:
        os.close(top)
    return None


def refusal(what, path, reason, consequence):
    """The message of a refused path, in the pidfile's words: what it is, why, what was not done, the fix."""
    kind = "directory" if what.endswith("directory") else "file"
    return (f"{what} {path} {reason}: whoever made it so could have this write or read a file of their "
            f"choosing, so it is not trusted and {consequence}. Check who changed it, then remove it (or "
            f"make it a {kind} owned by uid {os.geteuid()}, not a symbolic link, and not writable by "
            f"others: chmod go-w).")
