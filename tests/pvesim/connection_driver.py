"""Drive dflash.ops.pct_pipelined directly (exec_command, put_file, fetch_file), as Ansible's workers do,
against a pvesim container. Also a program: `python connection_driver.py <hostvars.json> put|fetch SRC DEST`
transfers one file in a fresh process and prints its peak memory above its resting size (MiB)."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CONNECTION = "dflash.ops.pct_pipelined"
# The connection's options an inventory entry sets (pvesim.sim.container_hostvars).
OPTION_VARS = ("ansible_host", "ansible_port", "ansible_user", "ansible_private_key_file", "proxmox_vmid")


def open_connection(hostvars, **options):
    """A connected pct_pipelined for the container of `hostvars`; `options` override its options."""
    from ansible import context
    from ansible.module_utils.common.collections import ImmutableDict
    from ansible.playbook.play_context import PlayContext
    from ansible.plugins.loader import connection_loader, init_plugin_loader

    context.CLIARGS = ImmutableDict(context.CLIARGS or {})
    init_plugin_loader([str(REPO)])
    conn = connection_loader.get(CONNECTION, PlayContext(), None)
    conn.set_options(var_options={k: hostvars[k] for k in OPTION_VARS}, direct=options or None)
    conn._connect()
    return conn


def peak_mib_of(call):
    """Peak resident memory of `call()` above the process's size before it (MiB)."""
    def status(field):
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
        return int(line.split()[1]) / 1024

    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    before = status("VmRSS:")
    call()
    return status("VmHWM:") - before


if __name__ == "__main__":
    hostvars_file, verb, src, dest = sys.argv[1:]
    conn = open_connection(json.loads(Path(hostvars_file).read_text()))
    transfer = conn.put_file if verb == "put" else conn.fetch_file
    print(f"{peak_mib_of(lambda: transfer(src, dest)):.1f}")
    conn.close()
