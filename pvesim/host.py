"""What several sims share on the machine: /usr/sbin/pct, the system known_hosts, a registry, a lock.

Each sim registers its state dir under /run/pvesim/sims while it is up. Shared files stay installed
while any registered sim is up, and each sim's host keys sit in a marked block of
/etc/ssh/ssh_known_hosts (the paramiko-based proxmox_pct_remote connection reads only that file and
~/.ssh/known_hosts) that its `down` removes.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import time
from pathlib import Path

PACKAGE_BIN = Path(__file__).resolve().parent / "bin"
PCT_PATH = Path("/usr/sbin/pct")
SYSTEM_KNOWN_HOSTS = Path("/etc/ssh/ssh_known_hosts")
RUN_DIR = Path("/run/pvesim")
REGISTRY = RUN_DIR / "sims"
LOCK_FILE = RUN_DIR / "lock"
PCT_MARKER = "pct for pvesim"


class SimError(RuntimeError):
    """A user-facing failure: bad input, or a sim that cannot be brought up, found or stopped."""


def sim_tag(state_dir):
    """A short name for one sim, unique per state dir (used in cgroup paths and registry entries)."""
    return hashlib.sha1(str(state_dir).encode()).hexdigest()[:10]


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


def install_pct():
    """Install (or refresh) /usr/sbin/pct: the dispatcher that runs each node's own package's pct."""
    source = (PACKAGE_BIN / "pct-dispatch").read_text().replace("@PCT@", str(PACKAGE_BIN / "pct")).encode()
    if not PCT_PATH.exists() or PCT_PATH.read_bytes() != source:
        tmp = PCT_PATH.with_name(".pct.pvesim-tmp")
        tmp.write_bytes(source)
        tmp.chmod(0o755)
        tmp.replace(PCT_PATH)


def remove_shared_files_if_unused():
    """Remove /usr/sbin/pct once no sim is registered (and only if it is ours, not a real Proxmox pct)."""
    if registered_state_dirs():
        return
    if PCT_PATH.is_file() and PCT_MARKER in PCT_PATH.read_text(errors="replace"):
        PCT_PATH.unlink()
    shutil.rmtree(REGISTRY, ignore_errors=True)


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


def set_system_known_hosts(state_dir, lines):
    """Put this sim's host keys in its own marked block of /etc/ssh/ssh_known_hosts."""
    text = SYSTEM_KNOWN_HOSTS.read_text() if SYSTEM_KNOWN_HOSTS.exists() else ""
    text = _without_block(text, state_dir)
    # A line for one of our [address]:port elsewhere is stale (a sim that died without `down`): this
    # sim holds that port now, and paramiko would take the first key it finds for it.
    ours = {line.split()[0] for line in lines}
    text = "".join(line for line in text.splitlines(keepends=True) if not line.split()[:1] or
                   line.split()[0] not in ours)
    if text and not text.endswith("\n"):
        text += "\n"
    begin, end = _block_markers(state_dir)
    _write_atomic(SYSTEM_KNOWN_HOSTS, text + begin + "".join(f"{line}\n" for line in lines) + end)


def remove_system_known_hosts(state_dir):
    if SYSTEM_KNOWN_HOSTS.exists():
        text = SYSTEM_KNOWN_HOSTS.read_text()
        stripped = _without_block(text, state_dir)
        if stripped != text:
            _write_atomic(SYSTEM_KNOWN_HOSTS, stripped)


def _write_atomic(path, text):
    tmp = path.with_name(f".{path.name}.pvesim-tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    tmp.replace(path)


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
