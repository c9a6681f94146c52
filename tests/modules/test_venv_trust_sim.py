"""In a pvesim container, through Ansible and the pct_pipelined connection: a venv whose site-packages
another user of the container owns, with a .pth file of theirs in it, is refused by training_run before its
interpreter ever starts, so the .pth file never runs as root; once root owns it again the same start runs
(and root's own .pth file with it)."""

from __future__ import annotations

import json
import shlex
import uuid

import pytest
from module_runner import ansible_module

from tests.waiting import wait_for

pytestmark = [pytest.mark.sim, pytest.mark.slow]

VMID = 201


def in_container(sim, command):
    node = next(n.name for n in sim.nodes if VMID in n.containers)
    done = sim.ssh(node, f"pct exec {VMID} -- /bin/sh -c {shlex.quote(command)}")
    return done


def test_a_pth_file_of_another_user_never_runs_as_root_in_the_container(sim):
    tag = f"pth-{uuid.uuid4().hex[:8]}"
    venv, marker = f"/opt/{tag}/venv", f"/root/{tag}-ran"
    pth = f"import os; open('{marker}', 'w').write(str(os.getuid()))"
    made = in_container(sim, f"/usr/bin/python3 -m venv --without-pip {venv} && "
                             f"site=$(echo {venv}/lib/python3*/site-packages) && chown nobody: \"$site\" && "
                             f"echo {shlex.quote(pth)} > \"$site/x.pth\" && chown nobody: \"$site/x.pth\"")
    assert made.returncode == 0, made.stderr
    args = dict(name=tag, command=[f"{venv}/bin/python", "-c", "import time; time.sleep(60)"],
                pidfile=f"/var/lib/dflash/{tag}.pid", log_path=f"/var/log/dflash/{tag}.log", startup_wait=0)
    result = ansible_module("training_run", args, host=f"ct{VMID}", inventory=str(sim.inventory_path))
    refused = result.get("failed") and "site-packages" in result["msg"] and "uid 65534" in result["msg"]
    assert refused, json.dumps(result)[:2000]
    assert in_container(sim, f"test -e {marker}").returncode == 1  # the .pth file never ran
    assert in_container(sim, f"chown -R root: {venv}").returncode == 0
    started = ansible_module("training_run", args, host=f"ct{VMID}", inventory=str(sim.inventory_path))
    try:
        assert started.get("status") == "running", json.dumps(started)[:2000]
        # root's own .pth file, root's code, runs once the interpreter starts
        assert wait_for(lambda: in_container(sim, f"cat {marker}").stdout == "0", timeout=60, interval=0.5)
    finally:
        stop = dict(args, state="stopped", stop_timeout=5)
        ansible_module("training_run", stop, host=f"ct{VMID}", inventory=str(sim.inventory_path))
        in_container(sim, f"rm -rf /opt/{tag} {marker}")
