"""The LXC side of `pct create` and `pct destroy`: pct (a standalone script) runs
`python -m pvesim.provision create|destroy <state dir> <node> <vmid> [<hostname>]` with the Python and
package `pvesim up` recorded for the node, so containers are made by the same code as the sim's own."""

import sys

from . import container, host, node


def main(argv):
    action, state_dir, node_name, vmid, *rest = argv
    files = node.NodeFiles(state_dir, node_name)
    if action == "create":
        # From a template: no NVIDIA user-space tools until something installs them in the container.
        container.write_lxc(files, host.sim_tag(files.state_dir.resolve()), int(vmid), rest[0],
                            driver_tools=False)
    elif action == "destroy":
        container.destroy(files, vmid)
    else:
        raise SystemExit(f"unknown action {action!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
