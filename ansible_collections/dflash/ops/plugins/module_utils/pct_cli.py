# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""pct (and the node's other Proxmox tools) run on the Proxmox VE node, with pct's failures told apart:
pct that cannot be run at all, and pct's own answers."""

from __future__ import annotations

import os
import re
import subprocess
from collections import namedtuple

# Config lines that pass a GPU through: cgroup device rules for the NVIDIA majors, bind mounts, devN
# entries (`devN: /dev/nvidia0` or `devN: path=/dev/nvidia0,mode=0666`); pct config prints `lxc.key: value`.
GPU_LINE = re.compile(r"^(lxc\.cgroup2?\.devices\.allow\s*[:=]\s*c\s+(195|50[0-9]|23[0-9]):"
                      r"|lxc\.mount\.entry\s*[:=]\s*/dev/nvidia|dev\d+:\s*(?:[^,\s]*,)*?(?:path=)?/dev/nvidia)")
DEVICE_OF_LINE = re.compile(r"(?:^dev\d+:\s*(?:[^,]*,)*?(?:path=)?|^lxc\.mount\.entry\s*[:=]\s*)"
                            r"(/dev/nvidia[^\s,]*)")
# The options of every module that runs pct on the node: the container, the node's name in messages,
# and the argv that runs pct (through sudo for a non-root node user).
PCT_ARGUMENTS = dict(
    vmid=dict(type="int", required=True),
    node_name=dict(type="str"),
    pct_argv=dict(type="list", elements="str", default=["/usr/sbin/pct"]),
)
# Where a Proxmox VE node has its tools that run as root (the packages pve-storage and pve-manager): called
# by these paths, so that a sudo rule naming them (inventory/production.example/sudoers.d) matches.
ROOT_TOOLS = {"pvesm": "/usr/sbin/pvesm", "pveam": "/usr/bin/pveam", "pvesh": "/usr/bin/pvesh"}
# What a shell or sudo answers for a command it cannot run.
CANNOT_RUN_CODES = (126, 127)
READ_TIMEOUT = 60
START_TIMEOUT = 300

# rc is None when the program could not be executed at all (stderr then says why).
Answer = namedtuple("Answer", "rc stdout stderr")


class CheckFailed(Exception):
    """A failed check: the message is what the user sees."""


def said(answer):
    """What pct said about a failure: its stderr, else its stdout, trimmed."""
    return answer.stderr.strip() or answer.stdout.strip()


def pct_cannot_run(answer, pct_path):
    """pct answers as a missing command does: it could not be executed, a shell's 126/127, or sudo's
    or a shell's 'not found' for pct's own path. A "No such file or directory" pct itself prints (a
    device a container's config names, say) is pct's answer, not a missing pct."""
    if answer.rc is None or answer.rc in CANNOT_RUN_CODES:
        return True
    path = re.escape(pct_path)
    missing = re.compile(rf"^(sudo: )?(\S+: )?{path}: (command not found|not found|No such file or "
                         "directory)", re.MULTILINE)
    return answer.rc != 0 and bool(missing.search(said(answer)))


def pct_missing_message(pct_path, node, answer):
    return (f"{pct_path} is missing on node {node} or cannot be run there ({said(answer)}). Is it a "
            f"Proxmox VE node, and is the inventory's ansible_host of {node} its address?")


class Pct:
    """pct on this node through its argv prefix; a pct that cannot be run fails every call."""

    def __init__(self, argv, node):
        self.argv = list(argv)
        self.path = self.argv[-1]
        self.node = node

    def answer(self, args, timeout=READ_TIMEOUT):
        argv = self.argv + [str(arg) for arg in args]
        try:
            proc = subprocess.run(argv, capture_output=True, encoding="utf-8", errors="replace", check=False,
                                  timeout=timeout, stdin=subprocess.DEVNULL, env=dict(os.environ, LC_ALL="C"))
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"{' '.join(argv)} did not answer within {timeout} s on node {self.node}"
                              ) from None
        except OSError as exc:
            return Answer(None, "", f"{argv[0]}: {exc.strerror}")
        return Answer(proc.returncode, proc.stdout, proc.stderr)

    def __call__(self, *args, timeout=READ_TIMEOUT):
        """pct's answer; fails when pct cannot be run at all. Through `pct exec`, an exit 126 or 127
        and a "not found" are the container command's, not pct's."""
        answer = self.answer(args, timeout)
        cannot_run = answer.rc is None if args[0] == "exec" else pct_cannot_run(answer, self.path)
        if cannot_run:
            raise CheckFailed(pct_missing_message(self.path, self.node, answer))
        return answer

    def tool(self, program, *args, timeout=READ_TIMEOUT, as_root=True):
        """Another tool of the node (pvesm, pveam, pvesh: by their absolute paths) run as pct is (through
        sudo when pct is), or one any user may run (nvidia-smi) as the caller with `as_root=False`; rc
        None when it cannot be run."""
        prefix = self.argv[:-1]
        if as_root:
            program = ROOT_TOOLS.get(program, program)
        if not as_root and "sudo" in prefix:  # sudo and its options (-n) go, what comes before stays
            at = prefix.index("sudo")
            rest = prefix[at + 1:]
            options = next((i for i, arg in enumerate(rest) if not arg.startswith("-")), len(rest))
            prefix = prefix[:at] + rest[options:]
        runner = Pct(prefix + [program], self.node)
        return runner.answer(args, timeout)

    def must(self, *args, timeout=READ_TIMEOUT):
        """stdout of a pct command that has to succeed."""
        answer = self(*args, timeout=timeout)
        if answer.rc != 0:
            raise CheckFailed(f"pct {' '.join(map(str, args))} failed on node {self.node} "
                              f"(exit {answer.rc}): {said(answer)}")
        return answer.stdout


def gpu_passthrough_lines(config_output):
    return [line for line in config_output.splitlines() if GPU_LINE.search(line)]


def passed_devices(lines):
    """The /dev/nvidia* device nodes the passthrough lines name, in config order, once each."""
    devices = []
    for line in lines:
        match = DEVICE_OF_LINE.search(line)
        if match and match.group(1) not in devices:
            devices.append(match.group(1))
    return devices
