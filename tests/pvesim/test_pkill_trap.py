"""The seeds' trap, kept as a regression document of the environment.

`pkill -f <script>` inside `bash -lc '...'` matches the very shell that runs it (its command line
contains the pattern): through ssh -> pct exec the whole command dies with SIGTERM, ssh exits 143 and
nothing after the pkill runs. This is the only place where pkill is used, on purpose, inside a
container, to show why the product stops runs by pidfile and process group instead.
"""

import pytest
from simtools import host_pid, in_ct

from pvesim import container, node, procs
from tests.waiting import wait_for

pytestmark = pytest.mark.sim

SCRIPT = "/root/train_dflash_pipeline.py"


def test_pkill_f_kills_its_own_shell_ssh_exits_143_and_nothing_after_runs(sim):
    start = sim.ssh("pve1", in_ct(200, "/bin/sh", "-c",
                                  f"printf 'import time\\ntime.sleep(120)\\n' > {SCRIPT}; "
                                  f"nohup python3 {SCRIPT} >/dev/null 2>&1 & echo $!"))
    assert start.returncode == 0, start.stderr
    trainer = host_pid(container.init_pid(node.NodeFiles(sim.state_dir, "pve1"), 200), int(start.stdout))
    assert trainer and procs.is_alive(trainer)

    trap = sim.ssh("pve1", f"pct exec 200 -- /bin/bash -lc 'pkill -f {SCRIPT} || true; echo after'")

    assert trap.returncode == 143
    assert "after" not in trap.stdout
    # The pkill did reach the trainer too; the shell that issued it died with it.
    assert wait_for(lambda: not procs.is_alive(trainer), timeout=5)
