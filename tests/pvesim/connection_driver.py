"""Drive dflash.ops.pct_pipelined directly (exec_command, put_file, fetch_file), as Ansible's workers do,
against a pvesim container, in a process of its own (Ansible's plugin loader must own the
`ansible_collections` package, which other tests import directly), of the Python of the Ansible under test
(pvesim.fleet.ANSIBLE_BIN: this venv's, or the ansible-core 2.20 or 2.21 venv of make test-newest):

    python connection_driver.py <hostvars.json> serve [<options.json>]   # JSON requests, one a line
    python connection_driver.py <hostvars.json> put|fetch SRC DEST        # prints the call's peak MiB

`Driver` is the client the tests use: `Driver(hostvars, pty=True).exec_command("tty")`.
"""

import base64
import json
import subprocess
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


def b64(data):
    return base64.b64encode(data).decode()


def serve(conn, requests, replies):
    """Answer each request line ({"op": "exec", "cmd", "in_data"} with base64 data, or {"op": "put" |
    "fetch", "src", "dest"}) with one reply line: the call's result, or {"error": its message}."""
    for line in requests:
        req = json.loads(line)
        try:
            if req["op"] == "exec":
                data = None if req.get("in_data") is None else base64.b64decode(req["in_data"])
                rc, out, err = conn.exec_command(req["cmd"], in_data=data)
                reply = {"rc": rc, "out": b64(out), "err": b64(err)}
            else:
                (conn.put_file if req["op"] == "put" else conn.fetch_file)(req["src"], req["dest"])
                reply = {}
        except Exception as e:  # the test asserts on it
            reply = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


class Driver:
    """A pct_pipelined connection served by a child process, with the plugin's three calls."""

    def __init__(self, hostvars, tmp_dir, **options):
        (Path(tmp_dir) / "hostvars.json").write_text(json.dumps(hostvars))
        (Path(tmp_dir) / "options.json").write_text(json.dumps(options))
        from pvesim.fleet import ANSIBLE_BIN  # here: the driver's own Python need not have pvesim's imports

        self.proc = subprocess.Popen([str(ANSIBLE_BIN / "python"), __file__,
                                      str(Path(tmp_dir) / "hostvars.json"), "serve",
                                      str(Path(tmp_dir) / "options.json")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _call(self, **req):
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self.proc.stdout.readline() or '{"error": "the driver exited"}')
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def exec_command(self, cmd, in_data=None):
        reply = self._call(op="exec", cmd=cmd, in_data=None if in_data is None else b64(in_data))
        return reply["rc"], base64.b64decode(reply["out"]), base64.b64decode(reply["err"])

    def put_file(self, src, dest):
        self._call(op="put", src=src, dest=dest)

    def fetch_file(self, src, dest):
        self._call(op="fetch", src=src, dest=dest)

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # stuck in a call (a test already failed on it)
            self.proc.kill()
            self.proc.wait()


if __name__ == "__main__":
    hostvars_file, verb, *args = sys.argv[1:]
    hostvars = json.loads(Path(hostvars_file).read_text())
    if verb == "serve":
        conn = open_connection(hostvars, **(json.loads(Path(args[0]).read_text()) if args else {}))
        serve(conn, sys.stdin, sys.stdout)
    else:
        from benchmarks.memory import peak_rss_bytes

        conn = open_connection(hostvars)
        transfer = conn.put_file if verb == "put" else conn.fetch_file
        print(f"{peak_rss_bytes(lambda: transfer(*args))[1] / 2**20:.1f}")
    conn.close()
