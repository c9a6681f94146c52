# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
#
# community.proxmox.proxmox_pct_remote, made safe and fast: ssh to the node, `pct exec` in the container.
#
# What it changes (docs/CONNECTION.md has the cases, the peer suites and the patch for upstream):
# - Nothing addressed to the container is interpreted by the node. The node's sshd hands the command
#   string to the node user's shell, so every word of `[sudo] /usr/sbin/pct exec <vmid> -- /bin/sh -c
#   <command>` is quoted for it; the container's /bin/sh is the only shell that parses the command.
#   Upstream joins the words unquoted, so a raw `echo x > /tmp/f` wrote /tmp/f on the node.
# - Every path of put_file/fetch_file is quoted for the container's shell (`cat > 'a b$c'`).
# - Both channels are read as they come, and stdin is fed in step with them, so no output size or
#   order deadlocks; put and fetch stream the file in fixed-size chunks (memory flat in its size).
# - Pipelining: a module goes to the container's python on stdin in one `pct exec` instead of five
#   (tmp dir, copy, chmod, run, remove). Ansible's own switches turn it off (ANSIBLE_PIPELINING,
#   [defaults] pipelining, ansible_pipelining), as they do for ansible-core's connections.
# - A PTY, when asked for (ANSIBLE_PARAMIKO_PTY), only for a command without stdin data, as
#   ansible-core's ssh connection does: a PTY would echo and line-edit a pipelined module.
# Everything else (paramiko, host key checking, the become method for a non-root node user, every
# option) is the collection's.
# What it takes from proxmox_pct_remote (community.proxmox 1.4 to 2.0, each tested; docs/CONNECTION.md): the
# class, its options, and the ssh client its _connect() (ConnectionBase's contract) leaves in `self.ssh`
# (a failure to connect is raised as AnsibleConnectionFailure here, which 2.0.0 fails to do itself).
# Of ansible-core (2.19 to 2.21): ConnectionBase, its become plugin interface, AnsiblePromptNoninteractive.
# Plugins keep their imports below the documentation block; its option lines are the collection's.
# ruff: noqa: E402, E501
from __future__ import annotations

# The options are the collection's (proxmox_pct_remote's, the same in community.proxmox 1.4.0, 1.6.0 and
# 2.0.0), with `pipelining` added and `pty` off by default; tests/modules/test_module_docs.py checks that
# they stay in step.
DOCUMENTATION = r"""
author: dflash-ops contributors (@dflash-ops)
name: pct_pipelined
short_description: community.proxmox.proxmox_pct_remote, with module pipelining
requirements:
- paramiko
description:
- 'Run tasks in Proxmox LXC containers with pct over ssh (paramiko), as P(community.proxmox.proxmox_pct_remote#connection)
  does, and pipeline modules: one C(pct exec) per module call.'
- Run commands or put/fetch files to an existing Proxmox LXC container using pct CLI via SSH.
- Uses the Python SSH implementation (Paramiko) to connect to the Proxmox host.
options:
  remote_addr:
    description:
    - Address of the remote target.
    default: inventory_hostname
    type: string
    vars:
    - name: inventory_hostname
    - name: ansible_host
    - name: ansible_ssh_host
    - name: ansible_paramiko_host
  port:
    description: Remote port to connect to.
    type: int
    default: 22
    ini:
    - section: defaults
      key: remote_port
    - section: paramiko_connection
      key: remote_port
    env:
    - name: ANSIBLE_REMOTE_PORT
    - name: ANSIBLE_REMOTE_PARAMIKO_PORT
    vars:
    - name: ansible_port
    - name: ansible_ssh_port
    - name: ansible_paramiko_port
    keyword:
    - name: port
  remote_user:
    description:
    - User to login/authenticate as.
    - Can be set from the CLI via the C(--user) or C(-u) options.
    type: string
    vars:
    - name: ansible_user
    - name: ansible_ssh_user
    - name: ansible_paramiko_user
    env:
    - name: ANSIBLE_REMOTE_USER
    - name: ANSIBLE_PARAMIKO_REMOTE_USER
    ini:
    - section: defaults
      key: remote_user
    - section: paramiko_connection
      key: remote_user
    keyword:
    - name: remote_user
  password:
    description:
    - Secret used to either login the SSH server or as a passphrase for SSH keys that require it.
    - Can be set from the CLI via the C(--ask-pass) option.
    type: string
    vars:
    - name: ansible_password
    - name: ansible_ssh_pass
    - name: ansible_ssh_password
    - name: ansible_paramiko_pass
    - name: ansible_paramiko_password
  use_rsa_sha2_algorithms:
    description:
    - Whether or not to enable RSA SHA2 algorithms for pubkeys and hostkeys.
    - On paramiko versions older than 2.9, this only affects hostkeys.
    - For behavior matching paramiko<2.9 set this to V(false).
    vars:
    - name: ansible_paramiko_use_rsa_sha2_algorithms
    ini:
    - key: use_rsa_sha2_algorithms
      section: paramiko_connection
    env:
    - name: ANSIBLE_PARAMIKO_USE_RSA_SHA2_ALGORITHMS
    default: true
    type: boolean
  host_key_auto_add:
    description: Automatically add host keys to C(~/.ssh/known_hosts).
    env:
    - name: ANSIBLE_PARAMIKO_HOST_KEY_AUTO_ADD
    ini:
    - key: host_key_auto_add
      section: paramiko_connection
    type: boolean
  look_for_keys:
    default: true
    description: Set to V(false) to disable searching for private key files in C(~/.ssh/).
    env:
    - name: ANSIBLE_PARAMIKO_LOOK_FOR_KEYS
    ini:
    - key: look_for_keys
      section: paramiko_connection
    type: boolean
  proxy_command:
    default: ''
    description:
    - Proxy information for running the connection via a jumphost.
    type: string
    env:
    - name: ANSIBLE_PARAMIKO_PROXY_COMMAND
    ini:
    - key: proxy_command
      section: paramiko_connection
    vars:
    - name: ansible_paramiko_proxy_command
  pty:
    default: false
    description:
    - Give a command a PTY (stdout and stderr then arrive merged), as a C(sudo) with C(requiretty) needs.
    - Only for a command without data on stdin (not for a pipelined module or a file transfer), as
      ansible-core's ssh connection does; a PTY would echo and line-edit that data.
    - Off by default; C(pct exec) as root, or through a NOPASSWD sudo rule, needs none.
    env:
    - name: ANSIBLE_PARAMIKO_PTY
    ini:
    - section: paramiko_connection
      key: pty
    type: boolean
  record_host_keys:
    default: true
    description: Save the host keys to a file.
    env:
    - name: ANSIBLE_PARAMIKO_RECORD_HOST_KEYS
    ini:
    - section: paramiko_connection
      key: record_host_keys
    type: boolean
  host_key_checking:
    description: Set this to V(false) if you want to avoid host key checking by the underlying tools Ansible
      uses to connect to the host.
    type: boolean
    default: true
    env:
    - name: ANSIBLE_HOST_KEY_CHECKING
    - name: ANSIBLE_SSH_HOST_KEY_CHECKING
    - name: ANSIBLE_PARAMIKO_HOST_KEY_CHECKING
    ini:
    - section: defaults
      key: host_key_checking
    - section: paramiko_connection
      key: host_key_checking
    vars:
    - name: ansible_host_key_checking
    - name: ansible_ssh_host_key_checking
    - name: ansible_paramiko_host_key_checking
  use_persistent_connections:
    description: Toggles the use of persistence for connections.
    type: boolean
    default: false
    env:
    - name: ANSIBLE_USE_PERSISTENT_CONNECTIONS
    ini:
    - section: defaults
      key: use_persistent_connections
  forward_agent:
    description: Enable SSH agent forwarding.
    type: boolean
    default: false
    env:
    - name: ANSIBLE_PARAMIKO_FORWARD_AGENT
    ini:
    - section: paramiko_connection
      key: forward_agent
  banner_timeout:
    type: float
    default: 30
    description:
    - Configures, in seconds, the amount of time to wait for the SSH banner to be presented. This option
      is supported by paramiko version 1.15.0 or newer.
    ini:
    - section: paramiko_connection
      key: banner_timeout
    env:
    - name: ANSIBLE_PARAMIKO_BANNER_TIMEOUT
  timeout:
    type: int
    default: 10
    description: Number of seconds until the plugin gives up on failing to establish a TCP connection.
    ini:
    - section: defaults
      key: timeout
    - section: ssh_connection
      key: timeout
    - section: paramiko_connection
      key: timeout
    env:
    - name: ANSIBLE_TIMEOUT
    - name: ANSIBLE_SSH_TIMEOUT
    - name: ANSIBLE_PARAMIKO_TIMEOUT
    vars:
    - name: ansible_ssh_timeout
    - name: ansible_paramiko_timeout
    cli:
    - name: timeout
  lock_file_timeout:
    type: int
    default: 60
    description: Number of seconds until the plugin gives up on trying to write a lock file when writing
      SSH known host keys.
    vars:
    - name: ansible_lock_file_timeout
    env:
    - name: ANSIBLE_LOCK_FILE_TIMEOUT
  private_key_file:
    description:
    - Path to private key file to use for authentication.
    type: string
    ini:
    - section: defaults
      key: private_key_file
    - section: paramiko_connection
      key: private_key_file
    env:
    - name: ANSIBLE_PRIVATE_KEY_FILE
    - name: ANSIBLE_PARAMIKO_PRIVATE_KEY_FILE
    vars:
    - name: ansible_private_key_file
    - name: ansible_ssh_private_key_file
    - name: ansible_paramiko_private_key_file
    cli:
    - name: private_key_file
      option: --private-key
  vmid:
    description:
    - LXC Container ID
    type: int
    vars:
    - name: proxmox_vmid
  proxmox_become_method:
    description:
    - Become command used in proxmox
    type: str
    default: sudo
    vars:
    - name: proxmox_become_method
  pipelining:
    description:
    - Send each module to the container's python on stdin in one C(pct exec) (no remote tmp dir, copy,
      chmod and cleanup round trips).
    - On by default here; Ansible's own pipelining settings turn it off as they do for ansible-core's
      connections, and this connection's own ones (later in each list) take precedence over them.
    default: true
    type: boolean
    env:
    - name: ANSIBLE_PIPELINING
    - name: ANSIBLE_PCT_PIPELINING
    ini:
    - section: defaults
      key: pipelining
    - section: connection
      key: pipelining
    - section: pct_connection
      key: pipelining
    vars:
    - name: ansible_pipelining
    - name: ansible_pct_pipelining
notes:
- 'When NOT using this plugin as root, you need to have a become mechanism, e.g. C(sudo), installed on
  Proxmox and setup so we can run it without prompting for the password. Inside the container, we need
  a shell, for example C(sh) and the C(cat) command to be available in the C(PATH) for this plugin to
  work.

  '
version_added: "0.3.0"
"""


import os
import select
import shlex
from io import BytesIO

from ansible.errors import (
    AnsibleConnectionFailure,
    AnsibleError,
    AnsibleFileNotFound,
    AnsiblePromptNoninteractive,
)
from ansible.module_utils.common.text.converters import to_bytes, to_text
from ansible.plugins.connection import ConnectionBase
from ansible.utils.display import Display
from ansible_collections.community.proxmox.plugins.connection import proxmox_pct_remote as upstream

display = Display()

PCT = "/usr/sbin/pct"
CONTAINER_SHELL = "/bin/sh"
CHUNK = 64 * 1024  # read and send size; a put or fetch holds one chunk of the file at a time
WINDOW_WAIT_S = 0.05  # how often a full send window is looked at again (paramiko gives it no fd)


def node_command(argv):
    """The one string the node's shell parses (sshd runs it as `<login shell> -c <string>`): each word
    quoted, so that shell only undoes the quoting and runs `argv` as it is."""
    return " ".join(shlex.quote(word) for word in argv)


def _raised_during(error, kind):
    """Whether `error` was raised while an exception of `kind` was handled (its cause or context chain)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, kind):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def pump(chan, stdin, stdout, stderr):
    """Feed `stdin` (a binary file, or None for none) to the channel while copying what it sends on
    stdout and stderr into the two binary files, until the command has closed both; returns its exit
    status. Every stream moves as soon as it can, so no buffer of either side fills up and stalls the
    other: a command may write any amount to stderr before stdout, or echo all of its stdin."""
    pending, feeding = b"", stdin is not None
    if not feeding:
        chan.shutdown_write()
    while True:
        moved = False
        while chan.recv_ready():
            stdout.write(chan.recv(CHUNK))
            moved = True
        while chan.recv_stderr_ready():
            stderr.write(chan.recv_stderr(CHUNK))
            moved = True
        if feeding and (chan.closed or chan.exit_status_ready()):
            feeding = False  # the command is gone: what it did not read is not wanted
        elif feeding and chan.send_ready():
            pending = pending or stdin.read(CHUNK)
            if pending:
                try:
                    pending = pending[chan.send(pending):]
                except OSError:  # the other side closed the channel meanwhile
                    feeding = False
            else:
                chan.shutdown_write()
                feeding = False
            moved = True
        done_writing = chan.eof_received or chan.closed  # sshd: the command closed stdout and stderr
        if done_writing and not feeding and not (chan.recv_ready() or chan.recv_stderr_ready()):
            return chan.recv_exit_status()
        if not moved:
            # The channel's fd wakes on data on either stream and on EOF; the send window has none.
            select.select([chan], [], [], WINDOW_WAIT_S if feeding else None)


class Connection(upstream.Connection):
    """proxmox_pct_remote with its commands and paths quoted for the node, both channels streamed, and
    module pipelining."""

    transport = "pct_pipelined"
    has_pipelining = True

    def _connect(self):
        try:
            return super()._connect()
        except Exception as e:
            # The collection asks to confirm an unknown node key on a terminal; without one (a deploy's
            # workers) ansible-core's prompt raises AnsiblePromptNoninteractive, which the collection turns
            # into a failure that says only "stdin is not interactive".
            if not _raised_during(e, AnsiblePromptNoninteractive):
                if isinstance(e, AnsibleError):
                    raise
                # community.proxmox 2.0.0 translates a failure to connect (refused, unreachable, a closed
                # banner) through a method it lacks, so it surfaces as an AttributeError raised while the
                # failure was handled: that failure, unreachable as any other connection's.
                failure = e.__context__ if isinstance(e, AttributeError) and e.__context__ else e
                raise AnsibleConnectionFailure(to_text(failure) or type(failure).__name__) from failure
            host, port = self.get_option("remote_addr"), self.get_option("port")
            raise AnsibleConnectionFailure(
                f"the ssh host key of {host} port {port} (the container's Proxmox node) is not known and"
                " host key checking is on, so nothing was run. Compare the node's key fingerprint"
                " (on the node: ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub) with what"
                f" `ssh-keyscan -p {port} {host} | ssh-keygen -lf -` shows, then add the key to"
                " ~/.ssh/known_hosts or /etc/ssh/ssh_known_hosts (this connection reads both)."
            ) from None

    def _pct_argv(self, container_argv):
        """`pct exec` of `container_argv` in this container; through the become method (sudo by default)
        when the node user is not root, since pct runs as root only."""
        argv = [PCT, "exec", str(self.get_option("vmid")), "--", *container_argv]
        if self.get_option("remote_user") != "root":
            argv = [*shlex.split(self.get_option("proxmox_become_method")), *argv]
        return argv

    def _build_pct_command(self, cmd):
        """The node's command line for `cmd`, which the container's /bin/sh alone parses (as a login
        shell parses what ansible-core's ssh connection sends)."""
        return node_command(self._pct_argv([CONTAINER_SHELL, "-c", cmd]))

    def _run(self, cmd, stdin, stdout, stderr, sudoable):
        """Run `cmd` in the container, streaming the three files; returns the exit status."""
        node_cmd = self._build_pct_command(cmd)
        try:
            transport = self.ssh.get_transport()
            transport.set_keepalive(5)
            chan = transport.open_session()
        except Exception as e:
            raise AnsibleConnectionFailure(f"Failed to open session: {to_text(e)}".rstrip(": ")) from e
        with chan:
            if self.get_option("pty") and sudoable and stdin is None:
                chan.get_pty(term=os.getenv("TERM", "vt100"), width=int(os.getenv("COLUMNS", 0)),
                             height=int(os.getenv("LINES", 0)))
            if self.get_option("forward_agent"):
                from paramiko.agent import AgentRequestHandler  # paramiko: the connection's requirement

                AgentRequestHandler(chan)
            display.vvv(f"EXEC {node_cmd}", host=self.get_option("remote_addr"))
            chan.exec_command(to_bytes(node_cmd, errors="surrogate_or_strict"))
            if self.become and self.become.expect_prompt():
                early = self._answer_become_prompt(chan)
                stdout.write(early)
                stderr.write(early)  # as ansible-core's paramiko connection returns it, on both
            rc = pump(chan, stdin, stdout, stderr)
        return rc

    def _answer_become_prompt(self, chan):
        """Read until the become method in the container says it succeeded or asks for its password
        (then send it); returns what was read."""
        seen = b""
        try:
            while True:
                chunk = chan.recv(CHUNK)
                if not chunk:
                    if b"unknown user" in seen:
                        raise AnsibleError(f"user {self.become.get_option('become_user')} does not exist")
                    return seen
                seen += chunk
                lines = seen.splitlines(True)
                if any(self.become.check_success(line) for line in lines):
                    return seen
                if any(self.become.check_password_prompt(line) for line in lines):
                    password = self.become.get_option("become_pass")
                    chan.sendall(to_bytes(password, errors="surrogate_or_strict") + b"\n")
                    return b""
        except TimeoutError:
            raise AnsibleError("ssh timed out waiting for privilege escalation.\n" + to_text(seen)) from None

    def exec_command(self, cmd, in_data=None, sudoable=True):
        """Run `cmd` in the container (its /bin/sh parses it, never the node's shell)."""
        ConnectionBase.exec_command(self, cmd, in_data=in_data, sudoable=sudoable)
        stdout, stderr = BytesIO(), BytesIO()
        stdin = None if in_data is None else BytesIO(in_data)
        rc = self._run(cmd, stdin, stdout, stderr, sudoable)
        if b"pct: not found" in stderr.getvalue() or b"pct: No such file" in stderr.getvalue():
            raise AnsibleError(f"pct not found in path of host: {to_text(self.get_option('remote_addr'))}")
        return rc, stdout.getvalue(), stderr.getvalue()

    def _transfer_failed(self, what, rc, stderr):
        text = to_text(stderr.getvalue(), errors="surrogate_or_replace").strip()
        if "cat: not found" in text:
            text = f"cat not found in path of container: {self.get_option('vmid')}"
        return AnsibleError(f"{what} failed in CT {self.get_option('vmid')} (exit {rc}): {text}")

    def put_file(self, in_path, out_path):
        """Stream a local file into the container: `cat > '<path>'` there, the file on stdin."""
        ConnectionBase.put_file(self, in_path, out_path)
        display.vvv(f"PUT {in_path} TO {out_path}", host=self.get_option("remote_addr"))
        if not os.path.exists(to_bytes(in_path, errors="surrogate_or_strict")):
            raise AnsibleFileNotFound(f"file or module does not exist: {in_path}")
        stderr = BytesIO()
        with open(to_bytes(in_path, errors="surrogate_or_strict"), "rb") as src:
            rc = self._run(f"cat > {shlex.quote(out_path)}", src, BytesIO(), stderr, sudoable=False)
        if rc != 0:
            raise self._transfer_failed(f"putting {in_path} to {out_path}", rc, stderr)

    def fetch_file(self, in_path, out_path):
        """Stream a container file to `out_path` (`cat < '<path>'` there); `out_path` is replaced only
        once the whole file has arrived."""
        ConnectionBase.fetch_file(self, in_path, out_path)
        display.vvv(f"FETCH {in_path} TO {out_path}", host=self.get_option("remote_addr"))
        out_b = to_bytes(out_path, errors="surrogate_or_strict")
        part = b"%s.%d.part" % (out_b, os.getpid())
        stderr = BytesIO()
        try:
            with open(part, "wb") as dst:
                rc = self._run(f"cat < {shlex.quote(in_path)}", None, dst, stderr, sudoable=False)
            if rc != 0:
                raise self._transfer_failed(f"fetching {in_path} to {out_path}", rc, stderr)
            os.replace(part, out_b)
        finally:
            if os.path.exists(part):
                os.unlink(part)
