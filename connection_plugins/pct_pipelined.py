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
from __future__ import annotations

import yaml
from ansible.errors import AnsibleConnectionFailure
from ansible_collections.community.proxmox.plugins.connection import proxmox_pct_remote as upstream


def _documentation() -> str:
    """The collection's options, with pipelining added (on by default) and the PTY off by default."""
    doc = yaml.safe_load(upstream.DOCUMENTATION)
    doc["name"] = "pct_pipelined"
    doc["short_description"] = "community.proxmox.proxmox_pct_remote, with module pipelining"
    doc["author"] = "dflash-ops"
    doc["description"] = [
        "Run tasks in Proxmox LXC containers with pct over ssh (paramiko), as"
        " community.proxmox.proxmox_pct_remote does, and pipeline modules: one `pct exec` per module call.",
        *doc.get("description", []),
    ]
    doc["options"]["pty"]["default"] = False
    doc["options"]["pty"]["description"] = (
        "Give the channel a PTY. Off by default: pipelining sends the module on stdin, which a PTY would"
        " echo and line-edit; pct as root or through a NOPASSWD sudo rule needs none.")
    doc["options"]["pipelining"] = {
        "description": ["Send each module to the container's python on stdin in one `pct exec`"
                        " (no remote tmp dir, copy, chmod and cleanup round trips)."],
        "default": True,
        "type": "boolean",
        "env": [{"name": "ANSIBLE_PCT_PIPELINING"}],
        "ini": [{"section": "pct_connection", "key": "pipelining"}],
        "vars": [{"name": "ansible_pct_pipelining"}, {"name": "ansible_pipelining"}],
    }
    doc.pop("extends_documentation_fragment", None)
    return yaml.safe_dump(doc, sort_keys=False)


# Ansible reads a connection's options from the loaded module's DOCUMENTATION attribute.
DOCUMENTATION = _documentation()


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
