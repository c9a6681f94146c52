# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""nvidia-smi as the collection asks it: the queries (fields and flags), the reading of its CSV answers
(NVIDIA's placeholders for values it cannot give) and what its failures mean.

Every module that reads GPUs goes through here, so a field is added, and a failure explained, once.
Where nvidia-smi runs (locally, in a container through `pct exec`, on the node through sudo) is the
caller's business; what it prints and returns is this file's.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from ansible_collections.dflash.ops.plugins.module_utils.pct_cli import CANNOT_RUN_CODES, Answer

PROGRAM = "nvidia-smi"
CSV_FORMAT = "--format=csv,noheader,nounits"
ANSWER_TIMEOUT = 30
# Lines nvidia-smi prints in place of rows (older drivers print the first for an empty process list).
NO_PROCESSES = "No running processes found"
NO_DEVICES = "No devices were found"
# What nvidia-smi prints in a field it cannot fill; any other "[...]" in a number field reads the same way.
PLACEHOLDERS = {"N/A", "[N/A]", "[Not Supported]", "[Insufficient Permissions]", "[Unknown Error]",
                "[GPU requires reset]", "[GPU is lost]", "[Not Found]", "ERR!"}

NUMBER, TEXT, FREE_TEXT = "number", "text", "free text"
# Each field the collection queries: its key in a parsed row and how its value reads. A free-text field
# (a GPU's name) may hold commas, so a query has at most one and the fields around it are counted from
# both ends of the line.
FIELDS = {
    "index": ("index", NUMBER),
    "uuid": ("uuid", TEXT),
    "name": ("name", FREE_TEXT),
    "memory.used": ("memory_used_mib", NUMBER),
    "memory.total": ("memory_total_mib", NUMBER),
    "utilization.gpu": ("utilization_pct", NUMBER),
    "minor_number": ("minor", NUMBER),  # the N of the GPU's /dev/nvidiaN
    "driver_version": ("driver", TEXT),
    "pid": ("pid", NUMBER),
    "gpu_uuid": ("gpu_uuid", TEXT),
    "used_memory": ("used_memory_mib", NUMBER),
}

# NVML_ERROR_LIB_RM_VERSION_MISMATCH: the user-space driver (libnvidia-ml) is not the loaded kernel
# module's version. In a container after the node's driver moved, its user space is the old one, and
# provision.yml installs the node's version (roles/proxmox_provision/tasks/nvidia.yml); on the node, a
# driver installed over a module that stayed loaded.
EXIT_VERSION_MISMATCH = 18
VERSION_MISMATCH = (
    "NVML's driver/library version mismatch (exit 18): the NVIDIA user-space driver here is not the "
    "version of the node's loaded kernel module. In a container, after the node's driver moved: reinstall "
    "the containers' user space of the node's version with ansible-playbook playbooks/provision.yml (-l "
    "<container>; it runs NVIDIA's installer of the node's version with --no-kernel-module; "
    "docs/OPERATIONS.md, \"Kernel and driver updates\"). On the node itself: the new driver's module is "
    "not loaded yet: reboot the node")
# nvidia-smi's own words for failures, most specific first; each names the usual cause.
KNOWN_FAILURES = (
    ("couldn't communicate with the NVIDIA driver",
     "nvidia-smi cannot reach the NVIDIA driver: the kernel module is not loaded (or, in a container, "
     "the /dev/nvidia* devices are not passed through)"),
    ("Driver/library version mismatch", VERSION_MISMATCH),
    ("Failed to initialize NVML: Unknown Error",
     "NVML failed to initialise with an unknown error; in a container this usually means access to "
     "the /dev/nvidia* devices was lost (device cgroup rules); restart the container"),
    ("Insufficient Permissions",
     "nvidia-smi lacks permission to open the GPU devices"),
    ("couldn't find libnvidia-ml.so",
     "the NVML library (libnvidia-ml.so) is not installed or not on the library path"),
    ("GPU is lost",
     "a GPU has fallen off the bus or become inaccessible; the node needs attention"),
)

# nvidia-smi(1), RETURN VALUE, whose codes are NVML's nvmlReturn_t; 18 (NVML_ERROR_LIB_RM_VERSION_MISMATCH in
# nvml.h) is not listed there but is what it returns on "Driver/library version mismatch".
EXIT_CODES = {
    2: "a supplied argument or flag is invalid",
    3: "the requested operation is not available on the target device",
    4: "the current user does not have permission to access the device",
    6: "a query to find an object was unsuccessful",
    8: "a device's external power cables are not properly attached",
    9: "the NVIDIA driver is not loaded",
    10: "the NVIDIA kernel detected an interrupt issue with a GPU",
    12: "the NVML shared library could not be found or loaded",
    13: "the local NVML does not implement this function",
    14: "the infoROM is corrupted",
    15: "a GPU has fallen off the bus or has otherwise become inaccessible",
    EXIT_VERSION_MISMATCH: "the NVML library and the driver versions do not match",
    255: "other error or internal driver error",
}


class NvidiaSmiError(Exception):
    """nvidia-smi could not be run, failed, or answered what cannot be read: the message says which."""


# ---------------------------------------------------------------------------------------------
# Values (pure)


def parse_number(raw, what, line):
    value = raw.strip()
    if value in PLACEHOLDERS or (value.startswith("[") and value.endswith("]")):
        return None
    try:
        return int(float(value))
    except ValueError:
        raise NvidiaSmiError(f"nvidia-smi gave {value!r} for {what} in line {line!r}") from None


def parse_text(raw):
    value = raw.strip()
    return None if value in PLACEHOLDERS else value


def data_lines(output):
    return [line for line in output.splitlines()
            if line.strip() and NO_PROCESSES not in line and NO_DEVICES not in line]


# ---------------------------------------------------------------------------------------------
# Queries (pure but for `read`)


class Query:
    """One `nvidia-smi --query-<kind>=<fields> --format=csv,noheader,nounits`: its arguments, and its
    answer read as one dict a line, keyed by FIELDS; placeholders read as None."""

    def __init__(self, kind, noun, names):
        self.kind, self.noun, self.names = kind, noun, tuple(names)
        kinds = [FIELDS[name][1] for name in self.names]
        self.free_at = kinds.index(FREE_TEXT) if FREE_TEXT in kinds else None

    @property
    def argv(self):
        """The arguments after the program's name."""
        return [f"--query-{self.kind}={','.join(self.names)}", CSV_FORMAT]

    def parse_line(self, line):
        values = line.split(",")
        count = len(self.names)
        if len(values) < count or (self.free_at is None and len(values) != count):
            raise NvidiaSmiError(f"unexpected nvidia-smi {self.noun} line (want {count} fields): {line!r}")
        if self.free_at is not None:
            after = len(values) - (count - self.free_at - 1)
            values = [*values[:self.free_at], ",".join(values[self.free_at:after]), *values[after:]]
        row = {}
        for position, name in enumerate(self.names):
            key, kind = FIELDS[name]
            raw = values[position]
            row[key] = parse_number(raw, name, line) if kind == NUMBER else parse_text(raw)
        return row

    def parse(self, output):
        return [self.parse_line(line) for line in data_lines(output)]

    def read(self, executable, timeout=ANSWER_TIMEOUT):
        """The rows of this query run by `executable` here, [] when nvidia-smi lists no device; raises
        NvidiaSmiError with the cause when it cannot be run, fails or answers what cannot be read."""
        answer = run(executable, self.argv, timeout)
        output = (answer.stdout + "\n" + answer.stderr).strip()
        if lists_no_device(output):
            return []
        if answer.rc != 0:
            raise NvidiaSmiError(explain_failure(answer.rc, output))
        return self.parse(answer.stdout)


# gpu_verify: what a GPU holds and does.
GPU_LOAD = Query("gpu", "GPU", ("index", "uuid", "name", "memory.used", "memory.total", "utilization.gpu"))
# pct_container_check in the container: the GPUs it sees, numbered from 0.
GPU_IDS = Query("gpu", "GPU", ("index", "uuid"))
# proxmox_container on the node: each GPU's device node and the driver a container's tools must match.
GPU_DEVICES = Query("gpu", "GPU", ("index", "uuid", "minor_number", "driver_version"))
# Every module that asks who uses a GPU.
COMPUTE_APPS = Query("compute-apps", "process", ("pid", "gpu_uuid", "used_memory"))


# ---------------------------------------------------------------------------------------------
# Failures (pure)


def cannot_run(rc):
    """nvidia-smi could not be executed (rc None, the convention of pct_cli.Answer) or a shell, sudo or
    `pct exec` answered as for a missing command."""
    return rc is None or rc in CANNOT_RUN_CODES


def lists_no_device(output):
    """nvidia-smi found no GPU: a state of the machine to report, not a failure to explain."""
    return NO_DEVICES in output


def explain_failure(rc, output):
    """A message for a failed nvidia-smi run: the known cause, else the meaning of its exit code."""
    text = " ".join(output.split())
    if rc == EXIT_VERSION_MISMATCH:
        return f"{VERSION_MISMATCH} (nvidia-smi exit {rc}: {text or 'no output'})"
    for marker, cause in KNOWN_FAILURES:
        if marker.lower() in text.lower():
            return f"{cause} (nvidia-smi exit {rc}: {text})"
    meaning = EXIT_CODES.get(rc, "unknown exit code")
    return f"nvidia-smi failed with exit {rc} ({meaning}): {text or 'no output'}"


# ---------------------------------------------------------------------------------------------
# Running it here


def find_executable(name=PROGRAM):
    """The path of nvidia-smi (a name looked up in PATH, or a path), None when there is none."""
    if "/" in name:
        return name if os.access(name, os.X_OK) and os.path.isfile(name) else None
    # sbin and /usr/local/bin are not always on the PATH of a non-interactive connection.
    extra = os.pathsep.join(("/usr/bin", "/usr/local/bin", "/usr/sbin", "/bin"))
    return shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + extra)


def run(executable, args, timeout=ANSWER_TIMEOUT):
    """nvidia-smi's Answer, in the C locale (the numbers and messages its manual documents); raises
    NvidiaSmiError when it cannot be started or does not answer in time."""
    try:
        proc = subprocess.run([executable, *args], capture_output=True, text=True, check=False,
                              timeout=timeout, stdin=subprocess.DEVNULL, env=dict(os.environ, LC_ALL="C"))
    except subprocess.TimeoutExpired:
        raise NvidiaSmiError(f"nvidia-smi did not answer within {timeout}s ({args[0]})") from None
    except OSError as exc:
        raise NvidiaSmiError(f"cannot run {executable}: {exc.strerror}") from None
    return Answer(proc.returncode, proc.stdout, proc.stderr)
