"""What several sims share on the machine: /usr/sbin/pct, the system known_hosts, a registry, a lock,
and the node user of a sim that has one (a machine user, its sudo rule, its authorized key).

Each sim registers its state dir under /run/pvesim/sims while it is up. Shared files stay installed
while any registered sim is up, and each sim's host keys sit in a marked block of
/etc/ssh/ssh_known_hosts (the paramiko-based proxmox_pct_remote connection reads only that file and
~/.ssh/known_hosts) that its `down` removes. A node user is made once (marked as pvesim's in its
GECOS field) and removed when no registered sim names it; each sim has its own sudoers.d file and
its own marked block of the user's authorized_keys.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

PACKAGE_BIN = Path(__file__).resolve().parent / "bin"
PCT_PATH = Path("/usr/sbin/pct")
SYSTEM_KNOWN_HOSTS = Path("/etc/ssh/ssh_known_hosts")
RUN_DIR = Path("/run/pvesim")
REGISTRY = RUN_DIR / "sims"
LOCK_FILE = RUN_DIR / "lock"
PCT_MARKER = "pct for pvesim"
# pvesm, pveam and pvesh at a real node's paths (pvesim/bin/pve-dispatch runs the calling node's own).
PVE_TOOL_PATHS = (Path("/usr/sbin/pvesm"), Path("/usr/bin/pveam"), Path("/usr/bin/pvesh"))
PVE_TOOLS_MARKER = "pve tools for pvesim"
# Where each node's tools (its nvidia-smi) live: a node user must be able to run them, and a sim's state
# dir may sit under a directory only root can enter (pytest's /tmp/pytest-of-root).
NODE_TOOLS = RUN_DIR / "nodes"
# Each sim's root authorized_keys, in a directory of its own (root's, 0700) on a path no other user may
# write: the nodes' sshd runs with StrictModes, which refuses a key file under a group- or world-writable
# directory, /tmp (1777) included (OpenSSH misc.c safe_path()), where a state dir may be.
KEYS = RUN_DIR / "keys"
# The pct of each installing package, copied where any user can read it (a checkout may sit in root's 0700
# home): /usr/sbin/pct runs it outside a node session, or for a user who cannot read provision.json, and
# it answers help and `please run as root` as the real pct does.
PACKAGE_PCT = RUN_DIR / "packages"
SUDOERS_DIR = Path("/etc/sudoers.d")
# The production sudo rule a non-root node user needs (pct, and nothing else).
PRODUCTION_SUDO_RULE = PACKAGE_BIN.parents[1] / "inventory/production.example/sudoers.d/ansible_pct"
NODE_USER_MARKER = "pvesim node user"
USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,30}$")


class SimError(RuntimeError):
    """A user-facing failure: bad input, or a sim that cannot be brought up, found or stopped."""


def sim_tag(state_dir):
    """A short name for one sim, unique per state dir (used in cgroup paths and registry entries)."""
    return hashlib.sha1(str(state_dir).encode()).hexdigest()[:10]


def keys_dir(state_dir):
    """The directory of one sim's root authorized_keys (KEYS), made root's with mode 0700 when missing and
    each directory above it root's and writable by root alone."""
    path = KEYS / sim_tag(state_dir)
    for directory in (RUN_DIR, KEYS):
        directory.mkdir(mode=0o755, exist_ok=True)
        os.chown(directory, 0, 0)
        directory.chmod(0o755)
    path.mkdir(mode=0o700, exist_ok=True)
    os.chown(path, 0, 0)
    path.chmod(0o700)
    return path


def state_dir_problem(state_dir, made_here=False):
    """Why `state_dir` must not hold a sim's state (its client key, its containers' roots, what root's pct
    and sshd read), or None: it must be root's with mode 0700 (pvesim makes it so), and each directory above
    it root's and writable by root alone, or sticky (/tmp: only an entry's owner may rename it). A
    directory another user made, or could replace, would let that user read the sim's key or give its
    root sessions files of their own."""
    path = Path(state_dir)
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if info.st_uid != 0 or stat.S_IMODE(info.st_mode) != 0o700:
        mode = stat.S_IMODE(info.st_mode)
        return (f"{path} is owned by uid {info.st_uid} with mode {mode:04o}, not root's with mode 0700"
                f"{'' if made_here else ' (pvesim makes its state dir so)'}")
    for parent in path.parents:
        above = parent.lstat()
        if above.st_uid != 0:
            return f"{path} is in {parent}, owned by uid {above.st_uid}, who could replace it"
        if above.st_mode & 0o022 and not above.st_mode & stat.S_ISVTX:
            return (f"{path} is in {parent}, which users other than root may write to (mode "
                    f"{stat.S_IMODE(above.st_mode):04o}) and so replace it")
    return None


def ensure_state_dir(state_dir):
    """Make `state_dir` (root's, mode 0700; missing parents 0755) or refuse the one that is there when
    state_dir_problem finds something against it; SimError names the fix."""
    path = Path(state_dir)
    made = False
    if not path.exists() and not path.is_symlink():
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        old = os.umask(0o077)
        try:
            path.mkdir(mode=0o700)
        finally:
            os.umask(old)
        made = True
    problem = state_dir_problem(path, made)
    if problem:
        raise SimError(f"state dir refused: {problem}. Another user could read the sim's key or have its "
                       f"root sessions use files of their own. Name a state dir that pvesim makes (a path "
                       f"that does not exist yet, under directories only root may write), or remove this one "
                       f"(python -m pvesim down --state-dir {path}) and bring the sim up again.")
    return path


@contextlib.contextmanager
def machine_lock():
    """Serialize up/down of all sims: they edit the same shared files."""
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    with open(LOCK_FILE, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def register(state_dir, record):
    """Register a sim with a copy of its record (sim.json), which outlives a deleted state dir."""
    REGISTRY.mkdir(parents=True, exist_ok=True)
    entry = REGISTRY / sim_tag(state_dir)
    tmp = REGISTRY / f".{entry.name}.tmp"
    tmp.write_text(record)
    tmp.replace(entry)


def unregister(state_dir):
    (REGISTRY / sim_tag(state_dir)).unlink(missing_ok=True)


def registered_record(state_dir):
    try:
        return json.loads((REGISTRY / sim_tag(state_dir)).read_text())
    except (OSError, ValueError):
        return None


def registered_state_dirs():
    if not REGISTRY.is_dir():
        return []
    dirs = set()
    for entry in REGISTRY.glob("[0-9a-f]*"):
        try:
            text = entry.read_text()
        except OSError:
            continue
        try:
            dirs.add(Path(json.loads(text)["state_dir"]))
        except (ValueError, KeyError, TypeError):
            dirs.add(Path(text.strip()))  # an entry holding only the path
    return sorted(dirs)


def _install(path, source):
    if not path.exists() or path.read_bytes() != source:
        tmp = path.with_name(f".{path.name}.pvesim-tmp")
        tmp.write_bytes(source)
        tmp.chmod(0o755)
        tmp.replace(path)


def install_pct():
    """Install (or refresh) the dispatcher (pvesim/bin/pve-dispatch) as /usr/sbin/pct, which runs each
    node's own package's pct, and as /usr/sbin/pvesm, /usr/bin/pveam and /usr/bin/pvesh, which run each
    node's own tools; a real Proxmox VE tool at one of the last three (without pvesim's marker) is left
    alone."""
    copy = PACKAGE_PCT / hashlib.sha1(str(PACKAGE_BIN).encode()).hexdigest()[:10]
    copy.mkdir(parents=True, exist_ok=True)
    for d in (copy, copy.parent):
        d.chmod(0o755)
    for source in PACKAGE_BIN.iterdir():  # pct with what it imports from its own directory
        if source.is_file() and not source.name.startswith("."):
            _install(copy / source.name, source.read_bytes())
    source = (PACKAGE_BIN / "pve-dispatch").read_text().replace("@PCT@", str(copy / "pct")).encode()
    _install(PCT_PATH, source)
    for path in PVE_TOOL_PATHS:
        if not path.exists() or PVE_TOOLS_MARKER in path.read_text(errors="replace"):
            _install(path, source)


def remove_shared_files_if_unused():
    """Remove the node users no registered sim names, and /usr/sbin/pct and the other tools once no sim
    is registered (and only if they are ours, not a real Proxmox VE's)."""
    remove_node_users_if_unused()
    if registered_state_dirs():
        return
    for path, marker in ((PCT_PATH, PCT_MARKER), *((p, PVE_TOOLS_MARKER) for p in PVE_TOOL_PATHS)):
        if path.is_file() and marker in path.read_text(errors="replace"):
            path.unlink()
    shutil.rmtree(REGISTRY, ignore_errors=True)
    shutil.rmtree(PACKAGE_PCT, ignore_errors=True)


def _block_markers(state_dir):
    return f"# BEGIN pvesim {state_dir}\n", f"# END pvesim {state_dir}\n"


def _without_block(text, state_dir):
    begin, end = _block_markers(state_dir)
    lines, out, inside = text.splitlines(keepends=True), [], False
    for line in lines:
        if line == begin:
            inside = True
        elif inside and line == end:
            inside = False
        elif not inside:
            out.append(line)
    return "".join(out)


def set_block(path, state_dir, lines, mode=0o644, owner=None, keep=lambda line: True):
    """Put `lines` in this sim's own marked block of the file at `path` (others' blocks stay, and the
    lines outside any block for which `keep` is true)."""
    text = _without_block(path.read_text() if path.exists() else "", state_dir)
    text = "".join(line for line in text.splitlines(keepends=True) if keep(line))
    if text and not text.endswith("\n"):
        text += "\n"
    begin, end = _block_markers(state_dir)
    _write_atomic(path, text + begin + "".join(f"{line}\n" for line in lines) + end, mode, owner)


def remove_block(path, state_dir):
    if path.exists():
        text = path.read_text()
        stripped = _without_block(text, state_dir)
        if stripped != text:
            st = path.stat()
            _write_atomic(path, stripped, st.st_mode & 0o777, (st.st_uid, st.st_gid))


def set_system_known_hosts(state_dir, lines):
    """Put this sim's host keys in its own marked block of /etc/ssh/ssh_known_hosts."""
    # A line for one of our [address]:port elsewhere is stale (a sim that died without `down`): this
    # sim holds that port now, and paramiko would take the first key it finds for it.
    ours = {line.split()[0] for line in lines}
    set_block(SYSTEM_KNOWN_HOSTS, state_dir, lines,
              keep=lambda line: not line.split()[:1] or line.split()[0] not in ours)


def remove_system_known_hosts(state_dir):
    remove_block(SYSTEM_KNOWN_HOSTS, state_dir)


def _write_atomic(path, text, mode=0o644, owner=None):
    tmp = path.with_name(f".{path.name}.pvesim-tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    if owner:
        os.chown(tmp, *owner)
    tmp.replace(path)


def node_tools_dir(state_dir):
    """The directory of one sim's node tools (world-readable, removed on `down`)."""
    return NODE_TOOLS / sim_tag(state_dir)


def ensure_node_user(user):
    """The machine user a sim's node sessions log in as: made if missing (a system user with a home,
    /bin/sh, and '*' for a password: no password login, and not locked, which sshd without PAM would
    refuse); an existing user is used as it is. Returns its pwd entry."""
    if not USER_NAME.match(user or "") or user == "root":
        raise SimError(f"node_user must be a user name other than root, got {user!r}")
    try:
        return pwd.getpwnam(user)
    except KeyError:
        pass
    res = subprocess.run(["useradd", "--system", "--create-home", "--home-dir", f"/home/{user}", "--shell",
                          "/bin/sh", "--comment", NODE_USER_MARKER, "--password", "*", user],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        raise SimError(f"useradd {user} failed: {res.stderr.strip()}")
    return pwd.getpwnam(user)


def authorize_node_user(state_dir, user, key_line):
    """The sim's client key in its block of the user's ~/.ssh/authorized_keys."""
    entry = pwd.getpwnam(user)
    ssh_dir = Path(entry.pw_dir) / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    os.chown(ssh_dir, entry.pw_uid, entry.pw_gid)
    set_block(ssh_dir / "authorized_keys", state_dir, [key_line], 0o600, (entry.pw_uid, entry.pw_gid))


def unauthorize_node_user(state_dir, user):
    try:
        home = Path(pwd.getpwnam(user).pw_dir)
    except KeyError:
        return
    remove_block(home / ".ssh" / "authorized_keys", state_dir)


def sudo_rules(state_dir, user, node_tools, rule_file=None):
    """This sim's sudoers.d file: the rules of `rule_file` (production's by default) for the user, plus
    pvesim's addition, the node's simulated driver tools. No environment is kept across sudo: under sudo,
    /usr/sbin/pct and the other dispatched tools find their node from the root sshd the session descends
    from (pvesim/bin/pve-dispatch), never from what the caller passes."""
    rule_file = Path(rule_file or PRODUCTION_SUDO_RULE)
    production = [line.strip() for line in rule_file.read_text().splitlines()
                  if line.strip() and not line.lstrip().startswith("#")]
    # Each user specification's user becomes the sim's (Defaults lines stay as they are).
    rules = [line if line.startswith("Defaults") else re.sub(r"^\S+", user, line) for line in production]
    return "".join(f"{line}\n" for line in [
        f"# Written by pvesim for the sim in {state_dir}; `pvesim down` removes it.",
        f"# The rule of {rule_file}, for {user}:",
        *rules,
        "# The simulated driver: each node's nvidia-smi reads the processes' environments (root's) as the",
        "# kernel driver would, and its lsmod the driver's state, so they rerun as root for another user.",
        f"{user} ALL = (root) NOPASSWD: {', '.join(str(tool) for tool in node_tools)}",
    ])


def install_sudo_rules(state_dir, user, node_tools, rule_file=None):
    """Install this sim's sudoers.d file, checked with visudo first (a broken file breaks sudo)."""
    if not shutil.which("visudo") or not shutil.which("sudo"):
        raise SimError("a node user needs sudo (apt-get install sudo; `make setup` installs it)")
    path = SUDOERS_DIR / f"pvesim-{sim_tag(state_dir)}"
    tmp = SUDOERS_DIR / f".{path.name}.tmp"  # sudo skips names with a dot
    tmp.write_text(sudo_rules(state_dir, user, node_tools, rule_file))
    tmp.chmod(0o440)
    res = subprocess.run(["visudo", "-cf", str(tmp)], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL)
    if res.returncode != 0:
        tmp.unlink()
        raise SimError(f"the sudo rules for {user} do not parse: {res.stdout.strip()} {res.stderr.strip()}")
    tmp.replace(path)


def remove_sudo_rules(state_dir):
    (SUDOERS_DIR / f"pvesim-{sim_tag(state_dir)}").unlink(missing_ok=True)


def remove_node_users_if_unused():
    """Remove the users pvesim made (its marker in GECOS) that no registered sim names."""
    wanted = set()
    for entry in REGISTRY.glob("[0-9a-f]*") if REGISTRY.is_dir() else []:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            wanted.add(json.loads(entry.read_text()).get("node_user"))
    for user in pwd.getpwall():
        if user.pw_gecos == NODE_USER_MARKER and user.pw_name not in wanted:
            # Fails while a process of the user lives (a session not yet gone): the next `down` retries.
            subprocess.run(["userdel", "--remove", user.pw_name], capture_output=True,
                           stdin=subprocess.DEVNULL)


def _cgroup_tops(tag):
    root = Path("/sys/fs/cgroup")
    if not root.is_dir():
        return []
    tops = [root / f"pvesim-{tag}"] + [d / f"pvesim-{tag}" for d in root.iterdir() if d.is_dir()]
    return [top for top in tops if top.is_dir()]


def cgroup_pids(tag):
    """Every process still in one of this sim's cgroups (its containers' processes and monitors)."""
    pids = set()
    for top in _cgroup_tops(tag):
        for dirpath, _, files in os.walk(top):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError):
                    pids.update(int(p) for p in Path(dirpath, "cgroup.procs").read_text().split())
    return pids


def remove_cgroups(tag):
    """Kill what is left in this sim's cgroups (a container whose files are gone can no longer be
    stopped by lxc-stop), then remove the cgroup directories, deepest first."""
    deadline = time.monotonic() + 10
    while (pids := cgroup_pids(tag)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    for top in _cgroup_tops(tag):
        for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)
