"""Nothing addressed to a container runs on its node: dflash.ops.pct_pipelined quotes every command and
every path for the node's shell, streams stdout, stderr and stdin in step, and streams files.

Each case runs for a root node user (the session sim, CT 201) and for a node user that reaches pct
through production's sudo rule (sudo_sim, CT 390). Upstream community.proxmox.proxmox_pct_remote fails
the first two (docs/CONNECTION.md)."""

import json
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from connection_driver import Driver
from simtools import in_ct

from pvesim.fleet import ANSIBLE_BIN, ansible_env
from pvesim.sim import container_hostvars

pytestmark = pytest.mark.sim

DRIVER = Path(__file__).with_name("connection_driver.py")
# File names that a shell would split, expand, run or re-quote (ansible-core's test_connection.yml
# uses the fourth), and one that a command would take for an option.
ODD_NAMES = ["with space.txt", "quote'single.txt", 'double"quote.txt', "dollar$HOME.txt", "semi;colon.txt",
             "汉语-['foo bar'].txt", "star*.txt", "back\\slash.txt", "amp&pipe|.txt", "tick`id`.txt",
             "paren$(id).txt", "new\nline.txt", "-leading-dash.txt"]


class Target:
    """A container, its node and who logs in there."""

    def __init__(self, sim, vmid):
        self.sim, self.vmid = sim, vmid
        self.node = sim.node_of(vmid).name
        self.hostvars = container_hostvars(sim, self.node, vmid)

    def in_ct(self, *argv):
        """Run argv in the container by hand (ssh to the node as root, then pct), not through the plugin."""
        return self.sim.ssh(self.node, in_ct(self.vmid, *argv))

    def on_node(self, command):
        return self.sim.ssh(self.node, command)

    def exists_in_ct(self, path):
        return self.in_ct("test", "-e", path).returncode == 0

    def exists_on_node(self, path):
        return self.on_node(f"test -e {json.dumps(path)}").returncode == 0


# The sudo user's cases under make test-reliability only (a sim of its own, a minute): make test reaches
# containers through sudo in every task of test_narrow_sudo.py and test_example_inventory.py.
@pytest.fixture(params=["root", pytest.param("sudo", marks=pytest.mark.reliability_full)])
def target(request):
    if request.param == "root":
        return Target(request.getfixturevalue("sim"), 201)
    return Target(request.getfixturevalue("sudo_sim"), 390)


@pytest.fixture
def conn(target, tmp_path_factory):
    c = Driver(target.hostvars, tmp_path_factory.mktemp("driver"))
    yield c
    c.close()


def finishes(call, timeout_s=120):
    """call()'s result, or a test failure if it has not returned in timeout_s (a deadlock)."""
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("value", call()), daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        pytest.fail(f"no answer after {timeout_s} s: the channel deadlocked", pytrace=False)
    return result["value"]


def test_a_raw_command_runs_whole_in_the_container(target):
    """Redirections, separators and command substitutions of a raw command are the container's: the
    files it writes exist in the container and not on the node, and both halves run in the container's
    mount namespace."""
    tag = f"/tmp/raw-{uuid.uuid4().hex[:8]}"
    command = (f"echo a > {tag}-redirect; echo b > {tag}-semi && echo $(echo c) > {tag}-subst"
               " | cat; readlink /proc/self/ns/mnt; readlink /proc/self/ns/mnt")
    res = subprocess.run([str(ANSIBLE_BIN / "ansible"), "-i", str(target.sim.inventory_path),
                          f"ct{target.vmid}", "-m", "ansible.builtin.raw", "-a", command], env=ansible_env(),
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout + res.stderr
    for suffix, content in (("-redirect", "a\n"), ("-semi", "b\n"), ("-subst", "c\n")):
        assert target.in_ct("cat", tag + suffix).stdout == content, suffix
        assert not target.exists_on_node(tag + suffix), f"{tag + suffix} was written on the node"
    namespaces = [line for line in res.stdout.splitlines() if line.startswith("mnt:[")]
    node_ns = target.on_node("readlink /proc/self/ns/mnt").stdout.strip()
    assert len(namespaces) == 2 and namespaces[0] == namespaces[1] != node_ns, (namespaces, node_ns)


def test_exec_command_gives_the_container_shell_the_command_as_it_is(target, conn):
    command = "printf '%s|' \"$0\" 'a  b' \"$(hostname)\" '$HOME' ; echo >&2 to-stderr; exit 7"
    rc, out, err = conn.exec_command(command)
    assert (rc, out, err) == (7, f"/bin/sh|a  b|ct{target.vmid}|$HOME|".encode(), b"to-stderr\n")


def test_odd_file_names_are_put_and_fetched_under_their_own_names(target, conn, tmp_path):
    remote_dir = f"/tmp/names-{uuid.uuid4().hex[:8]}"
    assert target.in_ct("mkdir", remote_dir).returncode == 0
    for i, name in enumerate(ODD_NAMES):
        local = tmp_path / f"src{i}"
        local.write_bytes(f"{i}: {name}\n".encode())
        conn.put_file(str(local), f"{remote_dir}/{name}")
    listing = target.in_ct("python3", "-c", f"import json, os; print(json.dumps(os.listdir({remote_dir!r})))")
    assert sorted(json.loads(listing.stdout)) == sorted(ODD_NAMES)
    assert not target.exists_on_node(remote_dir)
    for i, name in enumerate(ODD_NAMES):
        back = tmp_path / f"back{i}"
        conn.fetch_file(f"{remote_dir}/{name}", str(back))
        assert back.read_bytes() == f"{i}: {name}\n".encode(), name


def test_a_failed_fetch_names_the_file_and_leaves_nothing_behind(conn, tmp_path):
    dest = tmp_path / "dest"
    with pytest.raises(RuntimeError, match=r"fetching /nonexistent/it's here .*No such file"):
        conn.fetch_file("/nonexistent/it's here", str(dest))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command, in_data, expect", [
    # stderr filled far past any channel window before stdout says a word
    ("head -c 30000000 /dev/zero >&2; echo done", None, (b"done\n", 30_000_000)),
    # both streams at once, interleaved
    ("for i in 1 2 3 4 5; do head -c 4000000 /dev/zero; head -c 4000000 /dev/zero >&2; done", None,
     (20_000_000, 20_000_000)),
    # a command that echoes all of its stdin while it still reads it
    ("cat", b"x" * 20_000_000, (20_000_000, 0)),
    # a command that reads all of its stdin before it answers
    ("wc -c", b"y" * 20_000_000, (b"20000000\n", 0)),
    # a command that exits without reading most of it
    ("head -c 5", b"z" * 20_000_000, (b"zzzzz", 0)),
], ids=["stderr-first", "both", "echo-stdin", "read-stdin", "early-exit"])
def test_no_output_or_input_size_deadlocks(conn, command, in_data, expect):
    rc, out, err = finishes(lambda: conn.exec_command(command, in_data=in_data))
    got = tuple(x if isinstance(want, bytes) else len(x) for x, want in zip((out, err), expect, strict=True))
    assert (rc, got) == (0, expect)


def test_a_pty_is_given_to_commands_without_stdin_only(target, tmp_path):
    """With pty on (ANSIBLE_PARAMIKO_PTY), as ansible-core's ssh connection: a tty for a plain command, none
    for a command with data on stdin (a pipelined module, a put), which arrives exactly."""
    conn = Driver(target.hostvars, tmp_path, pty=True)
    try:
        rc, out, _ = finishes(lambda: conn.exec_command("tty"))
        assert rc == 0 and out.startswith(b"/dev/pts/"), out
        data = bytes(range(256)) * 4096
        rc, out, _ = finishes(lambda: conn.exec_command("tty >&2; cat", in_data=data))
        assert (rc, out == data) == (0, True)
    finally:
        conn.close()


def test_put_and_fetch_hold_a_chunk_not_the_file(target, tmp_path):
    """Peak memory of a put and a fetch, each in a fresh process: flat in the file's size (upstream holds
    the whole file, ~4x its size at the peak)."""
    hostvars = tmp_path / "hostvars.json"
    hostvars.write_text(json.dumps(target.hostvars))
    peaks = {}
    for mib in (4, 64):
        src = tmp_path / f"{mib}.bin"
        with src.open("wb") as fh:
            for _ in range(mib):
                fh.write(uuid.uuid4().bytes * 65536)
        remote = f"/tmp/{uuid.uuid4().hex[:8]}-{mib}.bin"
        for verb, args in (("put", (src, remote)), ("fetch", (remote, tmp_path / f"{mib}.back"))):
            res = subprocess.run([sys.executable, str(DRIVER), str(hostvars), verb, *map(str, args)],
                                 capture_output=True, text=True, timeout=120)
            assert res.returncode == 0, res.stderr
            peaks[verb, mib] = float(res.stdout)
        assert (tmp_path / f"{mib}.back").read_bytes() == src.read_bytes()
    for verb in ("put", "fetch"):
        assert peaks[verb, 64] < peaks[verb, 4] + 8, peaks


# Runs in the Python of the Ansible under test: connects to argv[3] port argv[4]; with argv[2] "unknown-key",
# the node's sshd offers a key no known_hosts file has (only paramiko's network part is replaced), with no
# terminal to confirm it on (a deploy's workers).
CONNECT = r"""
import sys, tempfile
sys.path.insert(0, sys.argv[1])
import paramiko
from ansible import context
from ansible.module_utils.common.collections import ImmutableDict
from ansible.playbook.play_context import PlayContext
from ansible.plugins.loader import connection_loader, init_plugin_loader

class OfferedKey:
    def get_name(self):
        return "ssh-ed25519"
    def get_fingerprint(self):
        return bytes(range(16))

def offer_unknown_key(client, hostname, **kwargs):
    client._policy.missing_host_key(client, hostname, OfferedKey())

if sys.argv[2] == "unknown-key":
    paramiko.SSHClient.connect = offer_unknown_key
context.CLIARGS = ImmutableDict()
init_plugin_loader([sys.argv[1]])
play_context = PlayContext()
play_context.connection_lockfd = tempfile.TemporaryFile().fileno()
conn = connection_loader.get("dflash.ops.pct_pipelined", play_context, None)
conn.set_options(direct={"remote_addr": sys.argv[3], "port": int(sys.argv[4]), "remote_user": "root",
                         "vmid": 200, "timeout": 5})
try:
    conn._connect()
except Exception as e:
    print(f"{type(e).__name__}: {e}")
"""


def connect(tmp_path, *args):
    """What the connection raises for CONNECT's case, in the Python of the Ansible under test."""
    res = subprocess.run([str(ANSIBLE_BIN / "python"), "-c", CONNECT, str(Path(__file__).parents[2]), *args],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                         env={**ansible_env(), "HOME": str(tmp_path)})
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_an_unknown_node_key_without_a_terminal_says_which_key_and_how_to_check_it(tmp_path):
    """Told apart by ansible-core's AnsiblePromptNoninteractive in the failure's chain (each tested
    community.proxmox turns it into a failure of its own words), not by those words."""
    out = connect(tmp_path, "unknown-key", "192.0.2.7", "2222")
    assert out.startswith("AnsibleConnectionFailure: the ssh host key of 192.0.2.7 port 2222 (the"
                          " container's Proxmox node) is not known"), out
    assert "ssh-keyscan -p 2222 192.0.2.7" in out


def test_a_node_that_refuses_the_connection_is_a_connection_failure(tmp_path):
    """Unreachable, as for any connection (community.proxmox 2.0.0 alone raises an AttributeError)."""
    with socket.socket() as bound:  # bound and not listening: a connection to it is refused
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        out = connect(tmp_path, "refuse", "127.0.0.1", str(port))
    assert out == f"AnsibleConnectionFailure: [Errno None] Unable to connect to port {port} on 127.0.0.1\n", (
        out)
