"""The README's commands, read from README.md as a user copies them, and run from a checkout's root as a user
runs them (tests/roles/test_example_inventory.py)."""

import os
import pty
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass

import jinja2

from pvesim.fleet import REPO, VENV_BIN

README = REPO / "README.md"
DEVICE_UNIT_TEMPLATE = (REPO / "ansible_collections" / "dflash" / "ops" / "roles" / "proxmox_host"
                        / "templates" / "dflash-nvidia-devices.service.j2")
SECTIONS = ("Day one on a real Proxmox node", "Everyday operations")
PLACEHOLDER = "..."
RECAP = re.compile(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


def section(text, title):
    """The text of the README's `## title` section."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README.md has no section '## {title}'"
    return match.group(1)


def readme_lines(text=None):
    """Every command of the sections' sh blocks (continuation lines joined, comments dropped), as argv,
    and every inline `cp ...` command of their prose."""
    text = text or README.read_text()
    commands = []
    for title in SECTIONS:
        body = section(text, title)
        for block in re.findall(r"```sh\n(.*?)```", body, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                argv = shlex.split(line, comments=True)
                if argv:
                    commands.append(argv)
        commands.extend(shlex.split(cp) for cp in re.findall(r"`(cp -r [^`]+)`", body))
    return commands


def readme_inline(program, *words):
    """The one command of the sections' prose (an inline `...` span, a line break in it a space, as Markdown
    shows it) that starts with `program` and includes every one of `words`, as a user copies it into a
    node's shell. Fails when none or several match."""
    found = []
    for title in SECTIONS:
        prose = re.sub(r"```.*?```", "", section(README.read_text(), title), flags=re.S)
        for span in re.findall(r"`([^`]+)`", prose):
            command = " ".join(span.split("\n"))
            if command.startswith(f"{program} ") and all(word in command for word in words):
                found.append(command)
    assert len(found) == 1, f"README.md's prose has {len(found)} `{program}` commands with {words}: {found}"
    return found[0]


def readme_command(program, *words, fill=None):
    """The one README command of `program` whose arguments include every one of `words` (e.g. the
    playbook); `fill` replaces the README's `...` placeholder. Fails when none or several match."""
    found = [argv for argv in readme_lines() if argv[0] == program and all(w in argv for w in words)]
    assert len(found) == 1, f"README.md has {len(found)} `{program}` commands with {words}: {found}"
    return [arg.replace(PLACEHOLDER, fill) if fill else arg for arg in found[0]]


def readme_unit():
    """The README's node unit (its `ini` block of the day-one section), as a user copies it."""
    [block] = re.findall(r"```ini\n(.*?)```", section(README.read_text(), SECTIONS[0]), re.S)
    return block


def device_unit(minors):
    """The proxmox_host role's boot unit as its template task renders it for a node whose GPUs have these
    minor numbers (Ansible's template module: trim_blocks, the text's trailing newline kept)."""
    env = jinja2.Environment(trim_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    template = env.from_string(DEVICE_UNIT_TEMPLATE.read_text())
    return template.render(ansible_managed="Ansible managed",
                           __proxmox_host_gpu_minors=[str(m) for m in minors])


def readme_deploy(*extra):
    """The README's plain everyday deploy (no -e), and `extra` arguments the README names in its prose."""
    [plain] = [argv for argv in readme_lines() if "playbooks/deploy.yml" in argv and "-e" not in argv]
    return [*plain, *extra]


def checkout(dest):
    """A checkout of the repo at `dest`: its tracked files, as a clone has them."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True)
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


@dataclass
class CommandResult:
    argv: list
    rc: int
    stdout: str

    @property
    def recap(self):
        """{host: {ok, changed, unreachable, failed}} from the play recap Ansible printed."""
        return {host: dict(zip(("ok", "changed", "unreachable", "failed"), map(int, counts), strict=True))
                for host, *counts in RECAP.findall(self.stdout)}

    def __str__(self):
        return f"{shlex.join(self.argv)}: rc={self.rc}\n{self.stdout[-4000:]}"

    __repr__ = __str__


def run_command(argv, cwd, timeout=900, env=None, terminal=False):
    """`argv` run from `cwd` as a user runs it: the controller's Ansible on PATH (the venv's), nothing else
    set but `env` (the user's HOME, EDITOR), so the checkout's ansible.cfg is the one Ansible finds. With
    `terminal`, on a terminal of its own (a pty), as `ansible-vault create` needs for its editor."""
    env = {**{key: value for key, value in os.environ.items() if not key.startswith("ANSIBLE_")},
           **(env or {})}
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '/usr/bin:/bin')}"
    if terminal:
        return on_a_terminal(argv, cwd, env, timeout)
    res = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=timeout)
    return CommandResult(list(argv), res.returncode, res.stdout)


def on_a_terminal(argv, cwd, env, timeout):
    """`argv` with a pty as its stdin, stdout and stderr; what it printed, read until it exits."""
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=secondary, stdout=secondary, stderr=secondary,
                            start_new_session=True)
    os.close(secondary)
    output = b""
    try:
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # EIO: the terminal's last user is gone
                break
            if not chunk:
                break
            output += chunk
        proc.wait(timeout=timeout)
    finally:
        os.close(primary)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return CommandResult(list(argv), proc.returncode, output.decode("utf-8", "replace"))


