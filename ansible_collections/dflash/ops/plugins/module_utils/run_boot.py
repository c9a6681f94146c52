# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""What starts a run again at its container's boot, written by the call that starts the run.

`training_run` with `boot` set ensures, in the container and in the same call as the start (no file
travels from the controller, no task of its own):

- `dflash-resume.pyz`: `run_resume` and the module_utils it imports, transitively, with a `__main__`, as
  one zip application for the container's python3 (the standard library only). It is packed from the
  sources this module itself brought (the AnsiballZ payload carries every module_utils a module
  imports, and this one imports `run_resume`), so it is always the collection's code of this deploy;
- `dflash-resume.service` and its link in `multi-user.target.wants` (what `systemctl enable` makes);
- the run's start file `<pidfile dir>/<name>.boot.json` (root, 0600), which `run_resume` reads.

Each file is written (through a temporary file and a rename) only when its bytes differ, so a restart
or a no-change deploy writes nothing. A changed unit under a running systemd is followed by `systemctl
daemon-reload`, as systemd wants after a unit file changed on disk; systemd runs when
`/run/systemd/system` exists (`sd_booted(3)`). pvesim's containers run pvesim's init, which reads the
enabled units at each boot (docs/PVESIM.md).
"""

from __future__ import annotations

import importlib
import io
import json
import os
import re
import shutil
import subprocess
import tempfile
import zipfile

# Imported so that AnsiballZ puts it (and what it imports) into this module's payload: the program is
# packed from those sources. Used for the start file's name too.
from ansible_collections.dflash.ops.plugins.module_utils import run_resume

PACKAGE = "ansible_collections.dflash.ops.plugins.module_utils"
PROGRAM = "/usr/local/lib/dflash-resume.pyz"
UNIT_DIR = "/etc/systemd/system"
UNIT_NAME = "dflash-resume.service"
WANTS = "multi-user.target.wants"
# The program: every run's outcome a JSON line on stdout (the journal), the directory of the start files
# its one argument.
MAIN = """import json
import sys

from ansible_collections.dflash.ops.plugins.module_utils.run_resume import resume_all

for result in resume_all(sys.argv[1] if len(sys.argv) > 1 else "/var/lib/dflash"):
    print(json.dumps(result, sort_keys=True), flush=True)
"""
UNIT = """# Written by the dflash.ops training_run module. At every boot of this container, starts again
# the DFlash training runs that were live when it stopped (never one stopped on purpose), once their GPUs
# are idle.
[Unit]
Description=Start the DFlash training runs that were live when the container stopped
Wants=network-online.target
After=network-online.target

[Service]
Type=simple
ExecStart={command}

[Install]
WantedBy=multi-user.target
"""
_IMPORT = re.compile(rf"^from {re.escape(PACKAGE)}(?:\.(\w+) import| import (\w+))", re.MULTILINE)


def systemd_quote(argument):
    """`argument` as one word of a unit's command line (systemd.syntax(7), systemd.service(5)): in double
    quotes, with backslash and double quote escaped, a newline as \\n, and `%` and `$` doubled so that
    systemd expands neither a specifier nor a variable in it."""
    escaped = argument.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return '"' + escaped.replace("%", "%%").replace("$", "$$") + '"'


def exec_start(argv):
    """A unit's ExecStart= value running `argv`, each argument quoted (systemd_quote)."""
    return " ".join(systemd_quote(argument) for argument in argv)


def sources(root="run_resume"):
    """{module name: source} of `root` and every module_utils it imports, transitively, read through
    their loaders (the payload's zip in a container, the files in a checkout)."""
    found, todo = {}, [root]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        module = importlib.import_module(f"{PACKAGE}.{name}")
        found[name] = module.__loader__.get_source(module.__name__)
        todo.extend(a or b for a, b in _IMPORT.findall(found[name]))
    return found


def _entry(name):
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.external_attr = 0o644 << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def pack(modules):
    """The zip application's bytes: the same sources always give the same bytes (fixed timestamps,
    sorted entries)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr(_entry("__main__.py"), MAIN)
        parts = PACKAGE.split(".")
        for depth in range(1, len(parts) + 1):  # zipimport finds a namespace package by its directory entry
            archive.writestr(_entry("/".join(parts[:depth]) + "/"), b"")
        for name in sorted(modules):
            archive.writestr(_entry(f"{'/'.join(parts)}/{name}.py"), modules[name])
    return buffer.getvalue()


def start_file(pidfile, name):
    return os.path.join(os.path.dirname(pidfile), name + run_resume.START_FILE)


def start_spec(params, status_file):
    """The start file's content: how this start runs the run (training_run's parameters), what run_resume
    needs to start it the same way."""
    return {
        "name": params["name"], "pidfile": params["pidfile"], "log_path": params["log_path"],
        "command": params["command"], "chdir": params["chdir"], "interpreter": params["interpreter"],
        "user": params.get("user"), "user_reads": params.get("user_reads") or [],
        **({"output_group": params["output_group"]} if params.get("output_group") else {}),
        "environment_file": params["environment_file"], "startup_wait": params["startup_wait"],
        "wait_for": params["wait_for"], "wait_timeout": params["wait_timeout"], "status_file": status_file,
        "gpus": params["idle_gpus"] or [], "max_memory_mib": params["idle_max_memory_mib"],
        "gpu_timeout": params["idle_timeout"],
    }


def _same_file(path, data):
    try:
        if os.path.islink(path):
            return False
        with open(path, "rb") as existing:
            return existing.read() == data
    except OSError:
        return False


def _write(path, data, mode):
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)  # a symbolic link at `path` is replaced, never followed
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def _link(path, target):
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, path)


def ensure(params, boot, check_mode=False):
    """Ensure the program, the unit, its link and the run's start file; returns {"changed": [paths],
    "start_file": path} (in check mode, what would change, nothing written)."""
    program = boot.get("program") or PROGRAM
    unit_dir = boot.get("unit_dir") or UNIT_DIR
    unit = os.path.join(unit_dir, UNIT_NAME)
    link = os.path.join(unit_dir, WANTS, UNIT_NAME)
    spec_path = start_file(params["pidfile"], params["name"])
    files = (
        (program, pack(sources()), 0o644),
        (unit, UNIT.format(command=exec_start([boot.get("python") or "/usr/bin/python3", program,
                                               os.path.dirname(params["pidfile"])])).encode(), 0o644),
        (spec_path, (json.dumps(start_spec(params, boot.get("status_file")), indent=4, sort_keys=True)
                     + "\n").encode(), 0o600),
    )
    changed = []
    for path, data, mode in files:
        if _same_file(path, data) and (os.stat(path).st_mode & 0o7777) == mode:
            continue
        changed.append(path)
        if not check_mode:
            _write(path, data, mode)
    link_target = os.path.join("..", UNIT_NAME)
    if not (os.path.islink(link) and os.readlink(link) == link_target):
        changed.append(link)
        if not check_mode:
            _link(link, link_target)
    # systemd reads the unit from UNIT_DIR; one written elsewhere (a test's directory) is not its concern.
    systemd = unit_dir == UNIT_DIR and os.path.isdir("/run/systemd/system") and shutil.which("systemctl")
    if unit in changed and not check_mode and systemd:
        subprocess.run(["systemctl", "daemon-reload"], check=False, capture_output=True)
    return {"changed": changed, "start_file": spec_path}
