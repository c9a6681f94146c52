# Copyright: dflash-ops contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
#
# community.proxmox.proxmox_pct_remote with pipelining: one `pct exec` per module call instead of five.
#
# The collection's connection already passes stdin through `pct exec` (its put_file is
# `pct exec <vmid> -- /bin/sh -c 'cat > FILE'` with the file on stdin); it only never says it can
# pipeline, so Ansible makes a remote tmp dir, copies the module there, chmods, runs and removes it:
# five ssh channels, five `pct exec`, five shells and a python in the container for one task. With
# pipelining the module goes to the container's python on stdin in one `pct exec`. Everything else
# (paramiko, host key checking, the sudo rule for a non-root user, every option) is the collection's.
#
# Pipelining needs a channel without a PTY (a PTY would echo and line-edit the module on stdin), so
# `pty` defaults to false here. `pct exec` as root, or through a NOPASSWD sudo rule, needs none.
# Plugins keep their imports below the documentation block; its option lines are the collection's.
# ruff: noqa: E402, E501
from __future__ import annotations

# The options are the collection's (community.proxmox 1.4.0, proxmox_pct_remote), with `pipelining` added
# and `pty` off by default; tests/modules/test_module_docs.py checks that they stay in step.
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
    description: 'Give the channel a PTY. Off by default: pipelining sends the module on stdin, which
      a PTY would echo and line-edit; pct as root or through a NOPASSWD sudo rule needs none.'
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
    - Send each module to the container's python on stdin in one `pct exec` (no remote tmp dir, copy,
      chmod and cleanup round trips).
    default: true
    type: boolean
    env:
    - name: ANSIBLE_PCT_PIPELINING
    ini:
    - section: pct_connection
      key: pipelining
    vars:
    - name: ansible_pct_pipelining
    - name: ansible_pipelining
notes:
- 'When NOT using this plugin as root, you need to have a become mechanism, e.g. C(sudo), installed on
  Proxmox and setup so we can run it without prompting for the password. Inside the container, we need
  a shell, for example C(sh) and the C(cat) command to be available in the C(PATH) for this plugin to
  work.

  '
version_added: 0.2.0
"""

from ansible.errors import AnsibleConnectionFailure
from ansible_collections.community.proxmox.plugins.connection import proxmox_pct_remote as upstream


class Connection(upstream.Connection):
    """proxmox_pct_remote that can pipeline (its exec_command already passes in_data to `pct exec`)."""

    transport = "pct_pipelined"
    has_pipelining = True

    def _connect(self):
        try:
            return super()._connect()
        except AnsibleConnectionFailure as e:
            # The collection asks to confirm an unknown node key on a terminal; without one (a deploy's
            # workers) all it says is "stdin is not interactive".
            if "stdin is not interactive" not in str(e):
                raise
            host, port = self.get_option("remote_addr"), self.get_option("port")
            raise AnsibleConnectionFailure(
                f"the ssh host key of {host} port {port} (the container's Proxmox node) is not known and"
                " host key checking is on, so nothing was run. Compare the node's key fingerprint"
                " (on the node: ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub) with what"
                f" `ssh-keyscan -p {port} {host} | ssh-keygen -lf -` shows, then add the key to"
                " ~/.ssh/known_hosts or /etc/ssh/ssh_known_hosts (this connection reads both)."
            ) from None
